"""Hangs found in seconds: stall reports that name the stuck rank with its stack and flight record,
desyncs said as such, the shutdown error carrying the report, stacks on demand (SIGUSR1 to
horovodrun, ``all_stacks()`` on rank 0).

Real launches of tests/integration/bin/hang_worker.py at np=3, under horovodrun in MPI and Gloo
mode, with a warning time of 3 s (``WARN``). Rank 2 is stuck in a function ``load_batch`` that reads
a FIFO nobody writes (or writes only once the test has seen what it waits for): no sleep decides the
order of events. Assertions are on content and order; the only time bounds are the issue's goals,
measured by the ranks' own clocks where they can be (the wait the report states).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.integration.conftest import REPO, horovodrun, horovodrun_argv, launcher_env

pytestmark = pytest.mark.integration

SCRIPT = str(Path(__file__).resolve().parent / "bin" / "hang_worker.py")
WARN = 3.0  # the stall warning time the launches set (the default, 60 s, would make the tests wait)
STALL = ["--stall-check-warning-time-seconds", f"{WARN:g}", "--stall-check-shutdown-time-seconds", "7"]
# The desync job: only its first report is read; the stall shutdown (which ends the job) comes 3 s
# after it (its text is the same report, should a loaded machine skip the warning).
DESYNC_STALL = ["--stall-check-warning-time-seconds", f"{WARN:g}", "--stall-check-shutdown-time-seconds", "6"]
_REPORT = re.compile(r"^\[0\]<stderr>:\[[^\]]* (WARNING|ERROR) horovod rank 0\] Stall: ", re.M)


def _mode_args(mode: str) -> list[str]:
    return ["--gloo"] if mode == "gloo" else ["--mpi"]


def _report_blocks(stderr: str) -> list[tuple[str, str]]:
    """Rank 0's logged stall reports: (level, text without the rank prefix)."""
    out = []
    starts = [m for m in _REPORT.finditer(stderr)]
    for m in starts:
        lines = []
        for line in stderr[m.start():].splitlines():
            if not line.startswith("[0]<stderr>:"):
                continue
            body = line[len("[0]<stderr>:"):]
            if lines and (body.startswith("[") or body.startswith("Traceback")):
                break
            lines.append(body)
            if body.startswith("In short:"):
                break
        out.append((m.group(1), "\n".join(lines)))
    return out


@pytest.fixture(scope="module")
def stall_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], subprocess.CompletedProcess[str]]:
    """The stuck-rank and the desync job of both modes, run at once: each mostly waits, idle, for
    its stall shutdown (7 s and 6 s), so together they take about as long as the longest."""
    procs: dict[tuple[str, str], subprocess.Popen[bytes]] = {}
    for kind, stall in (("stuck", STALL), ("desync", DESYNC_STALL)):
        for m in ("mpi", "gloo"):
            where = tmp_path_factory.mktemp(f"{kind}-{m}")
            arg = where / ("never" if kind == "stuck" else "unused")
            if kind == "stuck":
                os.mkfifo(arg)
            procs[(kind, m)] = subprocess.Popen(
                horovodrun_argv(*_mode_args(m), "-np", "3", *stall, "python", SCRIPT, kind, str(arg)),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=launcher_env(None), cwd=str(REPO))
    out: dict[tuple[str, str], subprocess.CompletedProcess[str]] = {}
    try:
        for key, proc in procs.items():
            try:
                stdout, stderr = proc.communicate(timeout=180)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
                stderr += b"\n(test: horovodrun killed after 180 s)"
            # Decoded by hand: text=True would turn the workers' carriage returns into newlines.
            out[key] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout.decode(), stderr.decode())
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


def test_stuck_rank_reported_with_its_stack_once_per_period(
        mode: str, stall_jobs: dict[tuple[str, str], subprocess.CompletedProcess[str]]) -> None:
    res = stall_jobs[("stuck", mode)]
    assert res.returncode != 0, res.stdout + res.stderr
    assert "DONE" not in res.stdout
    reports = _report_blocks(res.stderr)
    assert reports, res.stderr
    warnings = [text for level, text in reports if level == "WARNING"]
    errors = [text for level, text in reports if level == "ERROR"]
    # Once per period: a report at ~3 s and ~6 s, then the shutdown's at 7 s (every second would
    # give four or more).
    assert 1 <= len(warnings) <= 3 and len(errors) == 1, [t.splitlines()[0] for _, t in reports]
    assert reports[-1][0] == "ERROR"
    first = warnings[0]
    assert re.search(r"allreduce 'allreduce\.grad\.w' \(seq \d+\): ranks 0-1 submitted it and wait for "
                     r"[\d.]+(-[\d.]+)? s; rank 2 did not submit it\.", first), first
    assert re.search(r"rank 2 \(host \S+, pid \d+\) is in no collective: its main thread is in "
                     r"load_batch \(hang_worker\.py:\d+\)", first), first
    assert 'hang_worker.py", line' in first and ", in load_batch" in first
    assert re.search(r"done +allreduce 'allreduce\.grad\.w' \(seq \d+\)", first)  # its flight record
    # Within 10 s of the stall (the goal), not before the warning time: the wait the report
    # states, by the ranks' clocks.
    waited = float(re.search(r"wait for ([\d.]+)", first).group(1))
    assert WARN <= waited < 10.0, first
    # The shutdown error every waiting rank raises carries the report, not the generic text.
    for rank in (0, 1):
        assert re.search(rf"\[{rank}\]<stderr>:horovod\.common\.exceptions\.HorovodShutdownError: Horovod has "
                         r"been shut down because a collective stalled", res.stderr), res.stderr[-3000:]
    err1 = res.stderr[res.stderr.index("[1]<stderr>:horovod.common.exceptions.HorovodShutdownError"):]
    assert "[1]<stderr>:  rank 2 (host" in err1 and "load_batch" in err1


def test_desync_reported_as_such_with_both_names(
        mode: str, stall_jobs: dict[tuple[str, str], subprocess.CompletedProcess[str]]) -> None:
    res = stall_jobs[("desync", mode)]
    assert res.returncode != 0, res.stdout + res.stderr
    reports = _report_blocks(res.stderr)
    assert reports, res.stderr
    first = reports[0][1]
    m = re.search(r"Desync: rank 2 is in allreduce 'allreduce\.grad\.b' \(seq (\d+)\) while ranks 0-1 wait in "
                  r"allreduce 'allreduce\.grad\.a' \(seq (\d+)\)", first)
    assert m and m.group(1) == m.group(2), first  # the same position in each rank's sequence
    assert first.count("Desync:") == 1
    assert "In short: desync: rank 2 is in allreduce 'allreduce.grad.b'" in first


def _run_until(argv: list[str], env: dict[str, str], on_line, timeout: float) -> tuple[int, list[tuple[float, str]]]:
    """Run ``argv``, calling ``on_line(proc, lines)`` for each output line (stdout and stderr
    merged), until it ends; returns its status and the timed lines."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
                            text=True, errors="replace")
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
            on_line(proc, lines)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    try:
        rc = proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    t.join(5)
    return rc, lines


def test_sigusr1_prints_every_ranks_stack_and_the_job_goes_on(mode: str, tmp_path: Path) -> None:
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    state: dict[str, float] = {}

    def on_line(proc: subprocess.Popen[str], lines: list[tuple[float, str]]) -> None:
        text = lines[-1][1]
        if "STUCK" in text:
            state["stuck"] = 1
        if "READY" in text:
            state["ready"] = 1
        if state.get("stuck") and state.get("ready") and "sent" not in state:
            state["sent"] = time.monotonic()
            proc.send_signal(signal.SIGUSR1)
        dumps = {r for _, line in lines for r in range(3)
                 if line.startswith(f"[{r}]<stderr>:horovod: rank {r} ") and "stacks on demand" in line}
        if "sent" in state and len(dumps) == 3 and "all" not in state:
            state["all"] = time.monotonic()
            # Every rank has printed its stacks: let rank 2 go on (a writer on the FIFO).
            threading.Thread(target=lambda: Path(fifo).write_bytes(b"x"), daemon=True).start()

    rc, lines = _run_until(horovodrun_argv(*_mode_args(mode), "-np", "3", "python", SCRIPT, "usr1", str(fifo)),
                           launcher_env(), on_line, timeout=180)
    out = "\n".join(line for _, line in lines)
    assert rc == 0, out[-4000:]
    assert "horovodrun: SIGUSR1: asking every rank for its stacks" in out
    for r in range(3):
        assert f"[{r}]<stdout>:DONE {r} 6.0" in out, out[-3000:]  # the job finished, values right
    # Rank 2's main thread is in load_batch; the others' in their allreduce; each dump has the
    # flight record.
    assert re.search(r"\[2\]<stderr>:  File \"[^\"]*hang_worker\.py\", line \d+, in load_batch", out), out
    assert re.search(r"\[1\]<stderr>:    out = hvd\.allreduce\(x, name=name, op=hvd\.Sum\)", out), out
    for r in range(3):
        assert re.search(rf"\[{r}\]<stderr>:  done +allreduce 'allreduce\.grad\.w' \(seq 1\)", out), out
    # Every rank's stack within 5 s of the signal (the goal; generous for a loaded machine).
    assert state["all"] - state["sent"] < 5.0 * 3, state


def test_all_stacks_from_rank_0_reaches_a_rank_stuck_in_user_code(mode: str, tmp_path: Path) -> None:
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    res = horovodrun(*_mode_args(mode), "-np", "3", "python", SCRIPT, "all_stacks", str(fifo), timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    line = next(x for x in res.stdout.splitlines() if x.startswith("[0]<stdout>:ALL_STACKS "))
    stacks = {int(k): v for k, v in json.loads(line.split(" ", 1)[1]).items()}
    assert sorted(stacks) == [0, 1, 2]
    assert stacks[2].startswith("rank 2 (host ") and "main thread in load_batch (hang_worker.py:" in stacks[2]
    assert "all_stacks" in stacks[0]  # rank 0's main thread is the caller
    assert re.search(r"(submitted|negotiated) +allreduce 'allreduce\.grad\.w'", stacks[1])
    for r in range(3):
        assert f"[{r}]<stdout>:DONE {r} 6.0" in res.stdout


def test_stopped_rank_reported_with_host_and_pid_and_the_job_goes_on(mode: str, tmp_path: Path) -> None:
    """A rank that cannot answer (SIGSTOP) stops the engine's rounds: rank 0's watchdog names it
    as stopped, with its host and pid; SIGCONT lets the job finish."""
    state: dict[str, float] = {}

    def on_line(proc: subprocess.Popen[str], lines: list[tuple[float, str]]) -> None:
        text = lines[-1][1]
        m = re.search(r"rank 2 \(host \S+, pid (\d+)\): stopped \(process state T", text)
        if m and "cont" not in state:
            state["cont"] = time.monotonic()
            os.kill(int(m.group(1)), signal.SIGCONT)

    rc, lines = _run_until(horovodrun_argv(*_mode_args(mode), "-np", "3",
                                           "--stall-check-warning-time-seconds", f"{WARN:g}",
                                           "python", SCRIPT, "sigstop", str(tmp_path / "unused")),
                           launcher_env(), on_line, timeout=180)
    out = "\n".join(line for _, line in lines)
    assert "cont" in state, out[-4000:]
    assert rc == 0, out[-4000:]
    assert re.search(r"Stall: rank 0 has waited [\d.]+ s in the engine's negotiation for ranks that do not "
                     r"come to it", out), out
    assert re.search(r"rank 1 \(host \S+, pid \d+\): (waiting|running all along)", out), out
    assert "In short: rank 2 is stopped." in out
    for r in range(3):
        assert f"[{r}]<stdout>:DONE {r} 6.0" in out
