"""A failed rank never hangs a static job, and the report names the rank that caused the end.

Real launches (horovodrun in MPI and Gloo mode, and plain mpirun) of tests/integration/bin/
fail_at_step.py: one rank exits with code 3, raises, or is killed with SIGKILL, while the others
compute ("busy"), while they wait for it in an allreduce ("outside"), or while it waits in an
allreduce itself ("inside"). The job must end with the failing rank's exit status long before the
others would have finished (they compute for 60 s: the bound is END_WITHIN, generous for a loaded
machine, and no rank may reach its end), and the report's first entry must be that rank.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from horovod.testing import mpirun_command
from tests.integration.conftest import REPO, horovodrun, launcher_env

pytestmark = pytest.mark.integration

SCRIPT = str(Path(__file__).resolve().parent / "bin" / "fail_at_step.py")
# The computing ranks sleep 60 s: a job that waited for them ends after that, a fail-fast one at
# once (a few seconds idle; this bound holds on a machine at load 10).
END_WITHIN = 40.0
# how -> (exit status of the job, status words of the rank in the report)
EXPECT = {"exit3": (3, "exit code 3"), "raise": (1, "exit code 1"),
          "sigkill": (137, "killed by signal 9 (SIGKILL)")}


def failing_at(stdout: str, rank: int) -> float:
    m = re.search(rf"FAILING {rank} ([0-9.]+)", stdout)
    assert m, f"rank {rank} never reached its failure point:\n{stdout[-3000:]}"
    return float(m.group(1))


def first_entry(report: str) -> str:
    """The line naming the root cause in horovodrun's report."""
    lines = report.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Horovod detected that one or more processes exited"):
            return lines[i + 1].strip()
    raise AssertionError(f"no failure report in:\n{report[-3000:]}")


def check_report(res: subprocess.CompletedProcess[str], how: str, bad: int, np_: int,
                 ended: float, status_words: bool = True) -> None:
    want_rc, status = EXPECT[how]
    out = res.stdout + res.stderr
    took = ended - failing_at(res.stdout, bad)
    assert took < END_WITHIN, f"the job ended {took:.1f} s after rank {bad} failed\n{out[-3000:]}"
    assert "DONE" not in res.stdout, f"a rank finished its training although rank {bad} failed\n{out[-3000:]}"
    assert res.returncode == want_rc, f"exit status {res.returncode}, expected {want_rc}\n{out[-3000:]}"
    first = first_entry(res.stderr)
    assert first.startswith(f"rank {bad} ") and (status in first or not status_words), (
        f"report names '{first}', expected rank {bad} with {status}\n{res.stderr[-3000:]}")
    if how == "raise":
        assert f"error: RuntimeError: rank {bad} fails on purpose" in res.stderr, res.stderr[-3000:]
        assert f"[{bad}]<stderr>:RuntimeError: rank {bad} fails on purpose" in res.stderr, (
            res.stderr[-3000:])  # its traceback, forwarded with the rank's prefix
    others = res.stderr.split("Other ranks:", 1)[-1]
    for r in range(np_):
        if r != bad:
            assert not re.search(rf"rank {r} .*\(after the first failure\)$", others, re.M), (
                f"rank {r} is reported as failing by itself:\n{res.stderr[-3000:]}")


HOWS, WHERES = ("exit3", "raise", "sigkill"), ("busy", "outside", "inside")
CASES = [(how, where) for how in HOWS for where in WHERES]


def case_np(mode: str, how: str, where: str) -> int:
    """One launch per (mode, how, where), at np=2 or 3 alternating over the 3x3 grid and swapped
    between the modes: every (how, where) runs at np=2 in one mode and np=3 in the other, and in
    each mode every how and every where runs at both sizes (18 launches instead of 36)."""
    return 2 + (HOWS.index(how) + WHERES.index(where) + (mode == "gloo")) % 2


@pytest.mark.parametrize(("how", "where"), CASES)
def test_horovodrun_ends_job_and_names_the_failed_rank(mode: str, how: str, where: str) -> None:
    np_ = case_np(mode, how, where)
    bad = np_ - 1 if where != "outside" else 1
    res = horovodrun(f"--{mode}", "-np", str(np_), sys.executable, SCRIPT, how, where, str(bad),
                     timeout=120)
    check_report(res, how, bad, np_, time.time())


def test_coordinator_rank_failing_is_named(mode: str) -> None:
    np_ = {"mpi": 2, "gloo": 3}[mode]  # the next test takes the other size in each mode
    res = horovodrun(f"--{mode}", "-np", str(np_), sys.executable, SCRIPT, "raise", "outside", "0",
                     timeout=120)
    check_report(res, "raise", 0, np_, time.time())


def test_cause_named_even_when_its_peers_end_first(mode: str) -> None:
    """The failing rank shuts Horovod down and hangs on its way out: the others end first with
    HorovodShutdownError, but only because it left; the report must name it, by cause."""
    np_ = {"mpi": 3, "gloo": 2}[mode]  # the previous test takes the other size in each mode
    bad = np_ - 1
    res = horovodrun(f"--{mode}", "-np", str(np_), sys.executable, SCRIPT, "raise", "slowexit",
                     str(bad), timeout=120)
    # it was stopped while hanging: its status is how it was stopped, its error comes first
    check_report(res, "raise", bad, np_, time.time(), status_words=False)
    # the others ended with HorovodShutdownError (or were stopped first by the launcher)
    left = [r for r in range(np_ - 1)
            if re.search(rf"rank {r} .*because a peer left( in \w+ '[^']*')? \(.*HorovodShutdownError",
                         res.stderr)]
    stopped = [r for r in range(np_ - 1)
               if re.search(rf"rank {r} .*stopped after the first failure", res.stderr)]
    assert left and sorted(left + stopped) == list(range(np_ - 1)), res.stderr[-3000:]


@pytest.mark.parametrize(("how", "where", "np_"), [("exit3", "busy", 3), ("raise", "outside", 2),
                                                  ("sigkill", "inside", 3)])
def test_plain_mpirun_ends_job(np_: int, how: str, where: str) -> None:
    # each failure once, at np=2 or 3 (horovodrun's tests above run every case at both sizes)
    bad = np_ - 1
    cmd = mpirun_command(np_, [sys.executable, SCRIPT, how, where, str(bad)])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=launcher_env(),
                         cwd=str(REPO))
    ended = time.time()
    out = res.stdout + res.stderr
    took = ended - failing_at(res.stdout, bad)
    assert took < END_WITHIN, f"mpirun ended {took:.1f} s after rank {bad} failed\n{out[-3000:]}"
    assert "DONE" not in res.stdout, f"a rank finished its training although rank {bad} failed\n{out[-3000:]}"
    assert res.returncode == EXPECT[how][0], out[-3000:]
    if how == "sigkill":  # "prterun noticed that process rank 1 with PID ... exited on signal 9"
        assert re.search(rf"process rank {bad} with PID \d+ .*\s*.*signal 9", out), out[-3000:]
    else:  # Open MPI names the first process that failed as [prterun-<host>-<pid>@1,<rank>]
        m = re.search(r"Process name: \[[^\]]*@\d+,(\d+)\]", out)
        assert m and int(m.group(1)) == bad, out[-3000:]
        assert re.search(rf"Exit code:\s+{EXPECT[how][0]}\b", out), out[-3000:]


def test_horovodrun_killed_takes_mpirun_and_ranks_with_it() -> None:
    """horovodrun killed with SIGKILL (an OOM killer, a test timeout) must not leave mpirun and
    its ranks running orphaned."""
    from tests.integration.conftest import horovodrun_argv

    proc = subprocess.Popen(horovodrun_argv("--mpi", "-np", "2", sys.executable, SCRIPT, "raise",
                                            "busy", "5"),  # rank 5 does not exist: nobody fails
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=launcher_env(),
                            cwd=str(REPO), start_new_session=False)
    try:
        deadline = time.monotonic() + 60
        mine: list[int] = []
        while time.monotonic() < deadline and len(mine) < 3:
            mine = _descendants(proc.pid)
            time.sleep(0.2)
        assert any(b"prterun" in _cmdline(p) or b"mpirun" in _cmdline(p) for p in mine), mine
        proc.kill()
        proc.wait(10)
        # Each process notices within a second and its command gets 3 s of grace before SIGKILL;
        # the bound is generous for a loaded 2-core machine (left alone they would run forever).
        deadline = time.monotonic() + 30
        alive = mine
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if _alive(p)]
            time.sleep(0.2)
        assert not alive, ("left running after horovodrun was killed: "
                           f"{[(_cmdline(p), _parent(p)) for p in alive]} (command line, parent pid)")
    finally:
        if proc.poll() is None:
            proc.kill()


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (OSError, IndexError):
        return False


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def test_rank_that_exits_early_is_named(mode: str) -> None:
    """Rank 0 calls consolidate_state_dict() alone while rank 1 ends its program normally (exit
    0): the report names rank 1 as having exited early, with the collective rank 0 waited in,
    not rank 0's HorovodShutdownError (issue 45)."""
    script = str(Path(__file__).resolve().parent / "bin" / "early_exit.py")
    res = horovodrun(f"--{mode}", "-np", "2", sys.executable, script, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-3000:]
    assert "DONE 0" not in res.stdout, out[-3000:]
    m = re.search(r"FINISHED 1 ([0-9.]+)", res.stdout)
    assert m, out[-3000:]
    finished = time.strftime("%H:%M:%S", time.localtime(float(m.group(1))))
    assert "It was caused by a rank that exited early:" in res.stderr, res.stderr[-3000:]
    want = f"rank 1 exited with code 0 at {finished} while rank 0 waited in broadcast 'zero.consolidate.0.sz'"
    assert first_entry(res.stderr).startswith(want), res.stderr[-3000:]
    others = res.stderr.split("Other ranks:", 1)[-1]
    assert re.search(r"rank 0 .*exit code 1, because a peer left in broadcast 'zero\.consolidate\.0\.sz'",
                     others), res.stderr[-3000:]
    assert "stopped after the first failure" not in others, res.stderr[-3000:]
