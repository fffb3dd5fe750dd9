"""horovodrun end to end on this machine, in MPI and Gloo mode."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.integration.conftest import (
    REPO,
    WORKER,
    horovodrun,
    horovodrun_argv,
    launcher_env,
    tagged_json,
)

pytestmark = pytest.mark.integration


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# One size per mode, the other size in test_run_api.py's twin (horovod.run): every mode at an even
# and an odd world size across the two, one launch each.
@pytest.mark.parametrize(("mode", "np_"), [("mpi", 2), ("gloo", 3)])
def test_allreduce_correct_on_every_rank(mode: str, np_: int) -> None:
    res = horovodrun(f"--{mode}", "-np", str(np_), "python", WORKER, "allreduce", timeout=180)
    assert res.returncode == 0, res.stderr
    results = tagged_json(res.stdout, "RESULT")
    assert sorted(results) == list(range(np_)), res.stdout
    want = [sum(range(np_)) + i * np_ for i in range(4)]
    for r, got in results.items():
        case = f"rank {r} ({mode}, np={np_})"
        assert got["sum"] == want, f"{case}: allreduce -> {got['sum']}, expected {want}"
        assert (got["size"], got["local_rank"], got["local_size"]) == (np_, r, np_), case
        assert (got["cross_rank"], got["cross_size"]) == (0, 1), case


def test_gloo_backend_protocol_methods_on_every_rank() -> None:
    script = str(Path(WORKER).parent / "gloo_backend_check.py")
    res = horovodrun("--gloo", "-np", "3", "python", script, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    checks = tagged_json(res.stdout, "GLOO_CHECK")
    assert sorted(checks) == [0, 1, 2]
    assert checks[1]["alltoall_ints"] == [1, 11, 21] and checks[2]["reducescatter"] == [15.0, 18.0]
    # no process-wide warning filter, and no warning for a read-only send buffer
    assert all(c["filters_unchanged"] and c["readonly_warnings"] == [] for c in checks.values()), checks


def test_gloo_init_shutdown_init() -> None:
    res = horovodrun("--gloo", "-np", "2", "python", WORKER, "reinit", timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    rounds = re.findall(r"^\[(\d)\]<stdout>:ROUND (.*)$", res.stdout, re.MULTILINE)
    got = sorted((int(r), json.loads(d)["round"], json.loads(d)["sum"]) for r, d in rounds)
    assert got == [(r, i, [1.0 + 2 * i] * 2) for r in range(2) for i in range(3)], res.stdout


def test_gloo_identity_variables_per_rank() -> None:
    res = horovodrun("--gloo", "-np", "3", "python", WORKER, "ident")
    assert res.returncode == 0, res.stderr
    idents = tagged_json(res.stdout, "IDENT")
    for r in range(3):
        env = idents[r]["env"]
        assert env["HOROVOD_RANK"] == str(r) and env["HOROVOD_SIZE"] == "3", env
        assert env["HOROVOD_LOCAL_RANK"] == str(r) and env["HOROVOD_CROSS_SIZE"] == "1", env
        assert env["HOROVOD_HOSTNAME"] == "localhost" and env["HOROVOD_CONTROLLER"] == "gloo", env


def test_output_is_forwarded_live(mode: str, tmp_path: Path) -> None:
    flag = tmp_path / "seen"
    proc = subprocess.Popen(horovodrun_argv(f"--{mode}", "-np", "2", "python", WORKER, "wait-file",
                                            str(flag)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=launcher_env(), cwd=str(REPO))
    seen: list[str] = []

    def watch() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if len([x for x in seen if x.rstrip().endswith(">:waiting")]) == 2:
                flag.touch()  # only reached if both lines arrived while the workers still run

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    t.join(5)
    assert rc == 0, "".join(seen) + proc.stderr.read()
    assert {"[0]<stdout>:done\n", "[1]<stdout>:done\n"} <= set(seen), seen


def test_output_prefixes_partial_lines_unicode_and_carriage_returns(mode: str) -> None:
    res = horovodrun(f"--{mode}", "-np", "2", "python", WORKER, "output")
    assert res.returncode == 0, res.stderr
    for r in range(2):
        lines = [ln for ln in re.split(r"(?<=[\r\n])", res.stdout) if ln.startswith(f"[{r}]")]
        assert lines == [f"[{r}]<stdout>:part-one\n", f"[{r}]<stdout>:héllo ✓ 日本\n",
                         f"[{r}]<stdout>:10%\r", f"[{r}]<stdout>:20%\r", f"[{r}]<stdout>:100%\n",
                         f"[{r}]<stdout>:no newline at end\n"], f"rank {r}: {lines}"
        assert f"[{r}]<stderr>:err from {r}\n" in res.stderr


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_failure_stops_everyone_and_reports_first_rank(mode: str, how: str, tmp_path: Path) -> None:
    start = time.monotonic()
    args = (["fail", "1", "3"] if how == "exit" else ["kill", "1"]) + [str(tmp_path)]
    res = horovodrun(f"--{mode}", "-np", "3", "python", WORKER, *args, timeout=60)
    elapsed = time.monotonic() - start
    report = res.stderr
    assert res.returncode == (3 if how == "exit" else 137), report
    assert "The first process to do so was:" in report
    status = "exit code 3" if how == "exit" else "killed by signal 9 (SIGKILL)"
    assert f"rank 1 (host localhost, local rank 1): {status}" in report, report
    assert "| rank 1 is failing on purpose" in report, report
    assert re.search(r"rank 0 .*stopped after the first failure", report), report
    # the other ranks sleep 120 s: a job that waited for them would take that long (60 s holds
    # for three rank start-ups on a loaded machine)
    assert elapsed < 60, f"job took {elapsed:.1f} s to stop after rank 1 failed"
    grandchildren = [int(p) for p in re.findall(r"GRANDCHILD (\d+)", res.stdout)]
    assert len(grandchildren) == 2, res.stdout
    deadline = time.monotonic() + 5
    while any(pid_alive(p) for p in grandchildren) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in grandchildren if pid_alive(p)], "worker process trees were left running"


def test_sigint_reaches_every_worker(mode: str, tmp_path: Path) -> None:
    proc = subprocess.Popen(horovodrun_argv(f"--{mode}", "-np", "2", "python", WORKER, "sigint",
                                            str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=launcher_env(), cwd=str(REPO))
    assert proc.stdout is not None
    ready = 0
    out: list[str] = []
    deadline = time.monotonic() + 60
    try:
        while ready < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            out.append(line)
            ready += line.rstrip().endswith(">:ready")
        assert ready == 2, out
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=90)
        elapsed = time.monotonic() - start
    finally:
        proc.kill()
    text = "".join(out) + rest
    for r in range(2):
        got = (tmp_path / f"rank{r}").read_text() if (tmp_path / f"rank{r}").exists() else None
        # Gloo mode passes SIGINT itself; mpirun turns it into SIGTERM for the ranks.
        assert got == ("SIGINT" if mode == "gloo" else "SIGTERM"), f"rank {r}: {got}\n{text}{err}"
        if mode == "gloo":
            assert f"[{r}]<stdout>:got SIGINT\n" in text, text
    assert proc.returncode == 130 and "interrupted (SIGINT)" in err, err
    assert elapsed < 60, f"stopping took {elapsed:.1f} s (the workers would wait 120 s)"


@pytest.mark.parametrize("args, fragment", [
    (["-np", "2", "-H", "localhost:2,bad host:1"], "'bad host:1'"),
    (["-np", "5", "-H", "localhost:2"], "more processes (5) than there are available slots (2)"),
    (["-np", "2", "--hostfile", "/nonexistent/hosts"], "cannot read it"),
])
def test_bad_hosts_are_named_before_launch(args: list[str], fragment: str) -> None:
    res = horovodrun(*args, "python", WORKER, "ident")
    assert res.returncode == 2 and fragment in res.stderr, res.stderr
    assert "IDENT" not in res.stdout


def test_malformed_hostfile_line_is_named(tmp_path: Path) -> None:
    hf = tmp_path / "hosts"
    hf.write_text("localhost slots=2\nworker1 slots=\n")
    res = horovodrun("-np", "2", "--hostfile", str(hf), "python", WORKER, "ident")
    assert res.returncode == 2 and f"{hf}:2" in res.stderr, res.stderr


def test_missing_program_is_named(mode: str) -> None:
    res = horovodrun(f"--{mode}", "-np", "2", "no-such-program-hvd", "x")
    assert res.returncode == 1 and "'no-such-program-hvd': not found on PATH" in res.stderr, res.stderr


@pytest.mark.skipif(shutil.which("ssh") is None, reason="the ssh client is not installed")
def test_unreachable_host_shows_ssh_error() -> None:
    res = horovodrun("--gloo", "-np", "2", "-H", "localhost:1,no-such-host.invalid:1",
                     "--start-timeout", "10", "python", WORKER, "ident", timeout=90)
    assert res.returncode == 1, res.stderr
    assert "Could not connect to 1 host(s) via ssh" in res.stderr
    assert "no-such-host.invalid:" in res.stderr  # followed by ssh's own message
    assert "IDENT" not in res.stdout


def test_dry_run_prints_plan_and_starts_nothing(mode: str, tmp_path: Path) -> None:
    marker = tmp_path / "started"
    res = horovodrun("--dry-run", f"--{mode}", "-np", "3", "-H", "localhost:2,otherhost:2",
                     "--cycle-time-ms", "7", "touch", str(marker))
    assert res.returncode == 0, res.stderr
    assert not marker.exists()
    for r, host in enumerate(["localhost", "localhost", "otherhost"]):
        assert f"rank {r}: host {host}" in res.stdout
    assert "HOROVOD_CYCLE_TIME=7.0" in res.stdout and f"touch {marker}" in res.stdout
    if mode == "mpi":
        assert "--tag-output" in res.stdout and "-H localhost:2,otherhost:1" in res.stdout
    else:
        assert "HOROVOD_RANK=2" in res.stdout and "ssh" in res.stdout


def test_check_build_lists_what_is_available() -> None:
    res = horovodrun("--check-build")
    assert res.returncode == 0
    lines = res.stdout.splitlines()
    assert re.match(r"Horovod v\d+\.\d+\.\d+:", lines[0])
    import importlib.util

    def box(module: str) -> str:
        return "[X]" if importlib.util.find_spec(module) else "[ ]"

    # the frameworks this package has bindings for (upstream's list had MXNet, which has none here)
    assert lines[2:6] == ["Available Frameworks:", f"    {box('tensorflow')} TensorFlow", "    [X] PyTorch",
                          f"    {box('jax')} JAX"]
    assert "MXNet" not in res.stdout
    assert "Available Controllers:\n    [X] MPI\n    [X] Gloo" in res.stdout
    assert "Available Tensor Operations:\n    [ ] NCCL\n    [ ] DDL\n    [ ] CCL\n    [X] MPI\n" \
           "    [X] Gloo" in res.stdout


def test_version() -> None:
    import horovod

    res = horovodrun("--version")
    assert res.returncode == 0 and res.stdout.strip() == horovod.__version__


def test_gloo_output_filename_writes_per_rank_files(tmp_path: Path) -> None:
    res = horovodrun("--gloo", "-np", "2", "--output-filename", str(tmp_path), "python", WORKER,
                     "output")
    assert res.returncode == 0, res.stderr
    for r in range(2):
        assert (tmp_path / f"rank.{r}" / "stderr").read_text() == f"err from {r}\n"
        assert "héllo ✓ 日本\n" in (tmp_path / f"rank.{r}" / "stdout").read_text()


def test_config_file_and_flags_reach_worker_env(mode: str, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("params:\n  cycle_time_ms: 9\n  cache_capacity: 11\n")
    res = horovodrun(f"--{mode}", "-np", "2", "--config-file", str(cfg), "--cache-capacity", "22",
                     "-x", "HVD_TEST_VAR=hello", "python", WORKER, "env", "HOROVOD_CYCLE_TIME",
                     "HOROVOD_CACHE_CAPACITY", "HVD_TEST_VAR", "HOROVOD_SECRET_KEY",
                     env={"HOROVOD_CACHE_CAPACITY": "33"})
    assert res.returncode == 0, res.stderr
    for r in range(2):
        for want in ("HOROVOD_CYCLE_TIME=9.0", "HOROVOD_CACHE_CAPACITY=22", "HVD_TEST_VAR=hello"):
            assert f"[{r}]<stdout>:{want}\n" in res.stdout, res.stdout
        # The job secret is only set where a rendezvous needs it (Gloo mode), never printed here.
        assert f"[{r}]<stdout>:HOROVOD_SECRET_KEY=" in res.stdout


def test_mpi_verbose_shows_the_mpirun_command() -> None:
    res = horovodrun("--mpi", "--verbose", "-np", "2", "python", WORKER, "ident")
    assert res.returncode == 0, res.stderr
    assert re.search(r"horovodrun: .*mpirun .*--tag-output -np 2 -H localhost:2 --bind-to none "
                     r"--map-by slot", res.stderr), res.stderr
