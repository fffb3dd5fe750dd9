"""Horovod under a real Slurm (``tests/_slurm.py``: slurmctld, slurmd and munged on this machine).

Every test runs real ``srun``/``salloc``/``sbatch`` commands and checks every rank's values. No
``HOROVOD_SECRET_KEY`` is exported unless a test says so: the step's secret comes from MUNGE (or
a key file) as it would in a batch script that exports nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[2]
JOB = str(Path(__file__).resolve().parent / "bin" / "job.py")
STRANGER = "hvdstranger"


def _env(slurm, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD_", "SLURM_", "OMPI_COMM", "PMI", "TORCHELASTIC"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(slurm.env())
    env.update(extra or {})
    return env


def _run(slurm, argv: list[str], timeout: float = 180, extra: dict[str, str] | None = None,
         ) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, env=_env(slurm, extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout, cwd=str(REPO))
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        raise AssertionError(f"{argv} did not finish in {timeout} s:\n{out}") from None


def _job_lines(out: str) -> dict[int, dict]:
    lines = [json.loads(m.group(1)) for m in re.finditer(r"JOB (\{.*\})", out)]
    return {d["rank"]: d for d in lines}


def _check_values(out: str, np_: int, launcher: str = "slurm", local_size: int | None = None) -> None:
    got = _job_lines(out)
    assert sorted(got) == list(range(np_)), out[-3000:]
    local_size = np_ if local_size is None else local_size
    for r, d in got.items():
        assert d["size"] == np_ and d["launcher"] == launcher, d
        assert (d["local_rank"], d["local_size"], d["cross_size"]) == (r % local_size, local_size, 1), d
        if launcher == "slurm":
            assert (d["procid"], d["localid"]) == (str(r), str(r)), d  # Slurm's own numbers
        assert d["sum"] == [sum(float(i + k) for k in range(np_)) for i in range(4)], d
        assert d["gather"] == [float(k) for k in range(np_) for _ in range(k + 1)], d
        assert d["bcast"] == float(np_ - 1), d


@pytest.mark.parametrize("np_", [2, 3])
def test_srun_tasks_form_one_job(slurm, np_):
    """``srun -n 2`` (the batch script exported HOROVOD_SECRET_KEY) and ``srun -N 1
    --ntasks-per-node=3`` (no secret exported: MUNGE): one job of size N, with the ranks and local
    ranks Slurm gave. The np=3 job also runs the device plane's CPU twin
    (HOROVOD_TORCH_CPU_PLANE=1: its own store per process set), whose store is keyed from the step's
    MUNGE secret (the plain path under MUNGE is the stranger test's np=2 job)."""
    if np_ == 2:
        argv = ["srun", "-n", "2"]
        extra = {"HOROVOD_SECRET_KEY": "ab" * 32, "HOROVOD_SLURM_KEY": "file",
                 "HOROVOD_SLURM_KEY_DIR": "/nonexistent/keys"}  # neither MUNGE nor a key file used
    else:
        argv, extra = ["srun", "-N", "1", "--ntasks-per-node=3"], {"HOROVOD_TORCH_CPU_PLANE": "1"}
    res = _run(slurm, [*argv, sys.executable, JOB, "values"], extra=extra)
    assert res.returncode == 0, res.stdout[-3000:]
    _check_values(res.stdout, np_)
    if np_ == 3:
        assert all(d["plane_keyed"] for d in _job_lines(res.stdout).values()), res.stdout[-3000:]


def test_srun_failing_task_ends_the_step_naming_it(slurm):
    """Task 1 raises after init: the step ends (no hang); the output names rank 1 as the cause and
    every other rank as stopping because of it."""
    res = _run(slurm, ["srun", "-n", "3", sys.executable, JOB, "fail", "1"], timeout=240)
    out = res.stdout
    assert res.returncode != 0, out[-3000:]
    assert "horovod: rank 1 of 3 failed, ending the job: ValueError: task 1 fails on purpose" in out, out[-3000:]
    causes = re.findall(r"horovod: rank (\d) of 3 failed, ending the job", out)
    assert causes == ["1"], out[-3000:]
    stopped = sorted(re.findall(r"horovod: rank (\d) of 3 stops because another rank failed or left", out))
    assert stopped == ["0", "2"], out[-3000:]
    assert re.search(r"srun: error: \S+: tasks? [0-9,-]+: Exited with exit code [1-9]", out), out[-3000:]
    assert not _job_lines(out), out[-3000:]


# ------------------------------------------------------------------ the stranger
@pytest.fixture(scope="module")
def stranger():
    """Another user of this machine (made for the tests, removed after), and a directory it can
    read holding the probe and a copy of the store's protocol module and the one module it
    imports (standard library only)."""
    import tempfile

    made = subprocess.run(["id", "-u", STRANGER], capture_output=True).returncode != 0
    if made:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", STRANGER],
                       check=True, capture_output=True)
    uid = int(subprocess.run(["id", "-u", STRANGER], capture_output=True, text=True, check=True).stdout)
    d = Path(tempfile.mkdtemp(prefix="hvd-stranger-"))
    shutil.copy(REPO / "horovod" / "common" / "backends" / "authstore.py", d / "authstore.py")
    # authstore's one project import (standard library only), as a package of its own
    (d / "horovod" / "common").mkdir(parents=True)
    (d / "horovod" / "__init__.py").write_text("")
    (d / "horovod" / "common" / "__init__.py").write_text("")
    shutil.copy(REPO / "horovod" / "common" / "refusals.py", d / "horovod" / "common" / "refusals.py")
    for sub in (d / "horovod", d / "horovod" / "common"):
        sub.chmod(0o755)
    shutil.copy(Path(JOB).parent / "stranger_probe.py", d / "stranger_probe.py")
    d.chmod(0o755)  # the stranger may enter and read it; nothing more
    try:
        yield uid, d
    finally:
        shutil.rmtree(d, ignore_errors=True)
        if made:
            subprocess.run(["userdel", STRANGER], capture_output=True)


def _as_stranger(slurm, uid: int, argv: list[str], cwd: Path, stdin: bytes | None = None,
                 ) -> subprocess.CompletedProcess[bytes]:
    env = {"PATH": "/usr/bin:/bin", "SLURM_CONF": slurm.env()["SLURM_CONF"], "HOME": "/nonexistent"}
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv],
                          env=env, cwd=str(cwd), input=stdin, capture_output=True, timeout=120)


def _allocation(slurm, ntasks: int) -> str:
    """A job id of ``ntasks`` granted without a shell (``salloc --no-shell``): its steps' ids are
    known before they start (the first ``srun --jobid`` is step 0)."""
    res = _run(slurm, ["salloc", "--no-shell", "-n", str(ntasks)])
    got = re.search(r"Granted job allocation (\d+)", res.stdout)
    assert res.returncode == 0 and got, res.stdout
    return got.group(1)


def test_stranger_with_the_job_id_cannot_join_a_running_jobs_store(slurm, stranger, tmp_path):
    """A running ``srun -n 2`` job with no HOROVOD_SECRET_KEY, whose first store and key service
    candidate ports another process holds (task 0 falls back to later ones, which its READY line
    names): another user, who reads the job id with squeue, tries every key derivable from it on
    the job's store; all are refused (and logged by the store) while the job's own ranks joined
    and finish with the right values."""
    from horovod.common import slurm_ports
    from tests._ports import bind_order, hold_port

    uid, probe_dir = stranger
    flag = tmp_path / "go"
    job = _allocation(slurm, 2)
    step = {"SLURM_JOB_ID": job, "SLURM_STEP_ID": "0"}
    firsts = [bind_order(slurm_ports.step_ports(step, service))[0] for service in ("store", "key")]
    held = [hold_port(port) for port in firsts]  # None: another process holds it, as well
    proc = subprocess.Popen(["srun", f"--jobid={job}", "-n", "2", sys.executable, JOB, "wait", str(flag)],
                            env=_env(slurm), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(REPO))
    lines: list[str] = []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("READY "):
                break
        ready = json.loads(lines[-1][len("READY "):]) if lines and lines[-1].startswith("READY ") else None
        assert ready is not None, "".join(lines)[-3000:]
        assert (ready["job"], ready["step"]) == (job, "0"), ready
        # Task 0 bound later candidates, and the job names those: the probe below asks them.
        assert ready["port"] in slurm_ports.step_ports(step) and ready["port"] != firsts[0], (ready, firsts)
        assert ready["key_port"] in slurm_ports.step_ports(step, "key") and ready["key_port"] != firsts[1], \
            (ready, firsts)
        res = _as_stranger(slurm, uid, ["/usr/bin/python3", "stranger_probe.py", "127.0.0.1",
                                        str(ready["port"]), str(ready["key_port"])], probe_dir)
        out = res.stdout.decode(errors="replace") + res.stderr.decode(errors="replace")
        assert res.returncode == 0, out
        probe = json.loads(next(x for x in out.splitlines() if x.startswith("PROBE "))[len("PROBE "):])
        assert probe["squeue_rc"] == 0 and job in probe["squeue"], probe  # it knows the job id
        assert probe["joined"] == [], probe
        assert len(probe["refused"]) >= 8 and all(e == "StoreError" for _, e in probe["refused"]), probe
        # Task 0's key service closed once both ranks had joined: nothing left to ask.
        assert "ConnectionRefusedError" in probe.get("key_service", ""), probe
    finally:
        flag.touch()
        rest, _ = proc.communicate(timeout=180)
        for sock in held:
            if sock is not None:
                sock.close()
        _run(slurm, ["scancel", job])
    out = "".join(lines) + rest
    assert proc.returncode == 0, out[-3000:]
    _check_values(out, 2)
    assert re.search(r"store \S+ refused a connection from 127\.0\.0\.1:\d+", out), out[-3000:]


def test_munge_key_service_answers_strangers_with_what_they_cannot_decode(slurm, stranger):
    """Task 0's MUNGE key service, opened here (as the job's user): the stranger gets a
    credential that munged will not decode for it; a credential the stranger makes itself is
    refused by the job's tasks (made by another uid); the job's own user decodes the secret."""
    from horovod.common import slurm_secret

    uid, probe_dir = stranger
    secret, service = slurm_secret._serve_munge("127.0.0.1", [0], "7.0.0")
    port = service._sock.getsockname()[1]
    try:
        code = ("import socket,sys; c=socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=10); "
                "sys.stdout.buffer.write(c.makefile('rb').readline())")
        got = _as_stranger(slurm, uid, ["/usr/bin/python3", "-c", code, str(port)], probe_dir)
        assert got.returncode == 0 and got.stdout.startswith(b"MUNGE:"), got
        dec = _as_stranger(slurm, uid, ["unmunge"], probe_dir, stdin=got.stdout)
        assert dec.returncode != 0 and secret.encode() not in dec.stdout, dec
        assert b"Unauthorized credential" in dec.stderr, dec
        # The job's user (this process) asks the same service: it gets the secret.
        assert slurm_secret._fetch_munge("127.0.0.1", [port], "7.0.0", 1, 30) == secret
        # A stranger serving its own credential for the same step is not believed.
        forged = _as_stranger(slurm, uid, ["munge", "-s", f"horovod-slurm-step-secret 7.0.0 {'ab' * 32}"],
                              probe_dir)
        assert forged.returncode == 0, forged
        with pytest.raises(ValueError, match=f"made by uid {uid}"):
            slurm_secret._decode(forged.stdout.strip(), "7.0.0")
        # Nor is our own credential for another step.
        with pytest.raises(ValueError, match="for step 7.0.0, not 8.0.0"):
            slurm_secret._decode(slurm_secret._mint("7.0.0", secret), "8.0.0")
    finally:
        service.close()


def test_srun_key_file_when_munge_is_not_used(slurm, tmp_path):
    """HOROVOD_SLURM_KEY=file: task 0's secret travels in a private file (mode 0600 in a 0700
    directory), removed once the ranks have joined; np=3 gives the right values."""
    keys = tmp_path / "keys"
    res = _run(slurm, ["srun", "-n", "3", sys.executable, JOB, "values"],
               extra={"HOROVOD_SLURM_KEY": "file", "HOROVOD_SLURM_KEY_DIR": str(keys)})
    assert res.returncode == 0, res.stdout[-3000:]
    _check_values(res.stdout, 3)
    assert keys.stat().st_mode & 0o777 == 0o700
    assert list(keys.iterdir()) == []


def _tagged_lines(out: str) -> str:
    return "\n".join(re.sub(r"^\[\d+\]<stdout>:", "", x) for x in out.splitlines())


def test_horovodrun_inside_salloc(slurm):
    """``salloc -n 2 horovodrun -np 2 ...``: horovodrun's own job of 2 (Open MPI's mpirun runs it
    inside the allocation), not a Slurm step."""
    res = _run(slurm, ["salloc", "-n", "2", sys.executable, "-m", "horovod.runner", "-np", "2",
                       sys.executable, JOB, "values"], timeout=240)
    assert res.returncode == 0, res.stdout[-3000:]
    assert "Granted job allocation" in res.stdout, res.stdout[-3000:]
    _check_values(_tagged_lines(res.stdout), 2, launcher="mpi")


def test_horovodrun_gloo_inside_a_batch_step(slurm, tmp_path):
    """A batch script running ``srun -n 1 horovodrun --gloo -np 2``: the workers inherit a Slurm
    task's variables (SLURM_PROCID=0 of a 1-task step) and still join horovodrun's job of 2."""
    out_file = tmp_path / "batch.out"
    script = f"srun -n 1 {sys.executable} -m horovod.runner --gloo -np 2 {sys.executable} {JOB} values"
    res = _run(slurm, ["sbatch", "--parsable", "-n", "2", "-o", str(out_file), "--wrap", script])
    assert res.returncode == 0, res.stdout
    job = res.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 300
    while True:  # until the job has left the queue (sbatch --wait polls for up to 32 s at a time)
        state = _run(slurm, ["squeue", "-h", "-j", job, "-o", "%T"]).stdout.strip()
        if not state or "Invalid job id" in state:
            break
        assert time.monotonic() < deadline, f"batch job {job} still {state} after 300 s"
        time.sleep(0.5)
    out = out_file.read_text() if out_file.exists() else ""
    _check_values(_tagged_lines(out), 2, launcher="horovod")
    assert all(d["procid"] == "0" for d in _job_lines(_tagged_lines(out)).values()), out

