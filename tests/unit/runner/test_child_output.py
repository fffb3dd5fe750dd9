"""A worker's last lines always come before the launcher's verdict, and an orphan holding the
worker's pipes open never holds the launcher (``runner/child_output.py``).

The bad interleaving is forced, not waited for: the launcher's reader is held on the worker's
first line until the launcher has reaped the worker and is asking its readers for what is left
(``ChildOutput.ending``) or has already given its verdict (which a launcher that stops reading
after a deadline does: its verdict then comes first, and the held lines after it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from horovod.runner.elastic.workers import WorkerProcess
from horovod.runner.launch.commands import Command, shim_argv
from horovod.runner.launch.supervisor import Supervisor

LIMIT = 120.0  # only a guard against a hang: nothing below waits for a time to pass

# Writes lines to both streams, the last ones right before exiting with code 3.
WORKER = r"""
import sys
for i in range(5):
    print(f"out {i}", flush=True)
    print(f"err {i}", file=sys.stderr, flush=True)
sys.stdout.write("out last (no newline)")
sys.stdout.flush()
sys.exit(3)
"""

# Leaves an orphan in its own session (out of reach of the shim's clean-up of the worker's
# group) that inherited both pipes and keeps them open until the test kills it.
ORPHAN_WORKER = r"""
import subprocess, sys
orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                          start_new_session=True)
print(f"orphan {orphan.pid}", flush=True)
print("worker done", file=sys.stderr, flush=True)
"""


def _command(script: str) -> Command:
    env = dict(os.environ, HOROVOD_RANK="0")
    return Command(shim_argv([sys.executable, "-c", script]), env, (0,), "localhost")


def _hold_until(released: Callable[[], bool]) -> None:
    """Block this (reader) thread until ``released()``, checked as events arrive."""
    gate = threading.Event()
    deadline = threading.Timer(LIMIT, gate.set)
    deadline.daemon = True
    deadline.start()
    try:
        while not released() and not gate.is_set():
            gate.wait(0.01)
    finally:
        deadline.cancel()


def _ending(owner: Any) -> bool:
    output = getattr(owner, "output", None)
    ending = getattr(output, "ending", None)
    return ending is not None and ending.is_set()


def _kill_orphans(lines: list[str]) -> list[int]:
    pids = [int(line.split()[1]) for line in lines if line.startswith("orphan ")]
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return alive


def _run_supervisor(script: str, hold: bool) -> tuple[list[tuple[str, str, bool]], Any]:
    verdict = threading.Event()
    seen: list[tuple[str, str, bool]] = []  # (stream, text, the verdict was already given)
    sup: Supervisor

    def hook(rank: int | None, stream: str, text: str) -> None:
        if hold and not seen:
            _hold_until(lambda: verdict.is_set() or bool(sup._procs) and _ending(sup._procs[0]))
        seen.append((stream, text, verdict.is_set()))

    with open(os.devnull, "w") as null:
        sup = Supervisor([_command(script)], 1, line_hook=hook, stdout=null, stderr=null)
        result: list[Any] = []

        def run() -> None:
            result.append(sup.run(handle_signals=False))
            verdict.set()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(LIMIT)
        assert not t.is_alive(), "horovodrun's supervisor did not finish"
    return seen, result[0]


def test_supervisor_passes_on_every_last_line_before_its_verdict_however_late_the_reader() -> None:
    seen, outcome = _run_supervisor(WORKER, hold=True)
    late = [text for _, text, after in seen if after]
    assert not late, f"lines passed on after the verdict: {late}"
    assert [t for s, t, _ in seen if s == "stdout"] == [f"out {i}" for i in range(5)] + [
        "out last (no newline)"], f"when the verdict came, only these lines had come: {seen}"
    assert [t for s, t, _ in seen if s == "stderr"] == [f"err {i}" for i in range(5)], seen
    (rank0,) = outcome.exits
    assert (rank0.code, rank0.note) == (3, ""), "the shim's exit report was lost"


def test_supervisor_does_not_wait_for_an_orphan_holding_the_pipes() -> None:
    seen, outcome = _run_supervisor(ORPHAN_WORKER, hold=False)
    lines = [t for _, t, _ in seen]
    alive = _kill_orphans(lines)
    assert "worker done" in lines and alive, (lines, alive)  # the verdict came while it lived
    (rank0,) = outcome.exits
    assert (rank0.code, rank0.note) == (0, "")


class _Sink:
    """A stream for a worker's prefixed lines: records them, holding the first one until
    ``release()`` says so."""

    def __init__(self, release: Callable[[], bool] | None, verdict: threading.Event,
                 seen: list[tuple[str, bool]]) -> None:
        self.release, self.verdict, self.seen = release, verdict, seen

    def write(self, line: str) -> None:
        if self.release is not None and not self.seen:
            _hold_until(self.release)
        self.seen.append((line.rstrip("\n"), self.verdict.is_set()))

    def flush(self) -> None:
        pass


def _run_worker(script: str, hold: bool) -> tuple[list[tuple[str, bool]], Any]:
    verdict = threading.Event()
    ended: list[Any] = []
    seen: list[tuple[str, bool]] = []
    box: list[WorkerProcess] = []

    def release() -> bool:
        return verdict.is_set() or bool(box) and _ending(box[0])

    def on_exit(code: int | None, sig: int | None, record: Any) -> None:
        ended.append((code, sig))
        verdict.set()

    sink = _Sink(release if hold else None, verdict, seen)
    stream: Any = sink
    box.append(WorkerProcess(_command(script), "w0", lambda: 0, on_exit, stdout=stream,
                             stderr=stream))
    assert verdict.wait(LIMIT), "the worker's end was never reported"
    return seen, ended[0]


def test_elastic_worker_passes_on_every_last_line_before_its_end_however_late_the_reader() -> None:
    seen, (code, sig) = _run_worker(WORKER, hold=True)
    late = [line for line, after in seen if after]
    assert not late, f"lines passed on after the worker's end was reported: {late}"
    texts = [line.split(":", 1)[1].strip() if ":" in line else line for line, _ in seen]
    assert [t for t in texts if t.startswith("out")] == [f"out {i}" for i in range(5)] + [
        "out last (no newline)"], f"when its end was reported, only these lines had come: {seen}"
    assert [t for t in texts if t.startswith("err")] == [f"err {i}" for i in range(5)], seen
    assert (code, sig) == (3, None)


def test_elastic_worker_end_is_not_held_by_an_orphan_holding_the_pipes() -> None:
    seen, (code, sig) = _run_worker(ORPHAN_WORKER, hold=False)
    texts = [line.split(":", 1)[1].strip() for line, _ in seen]
    alive = _kill_orphans(texts)
    assert "worker done" in texts and alive, (seen, alive)
    assert (code, sig) == (0, None)


@pytest.mark.parametrize("orphan", [False, True])
def test_child_output_takes_what_the_reaped_child_left_and_stops(orphan: bool) -> None:
    # The reader itself, started only once the child has written 30 KiB and been reaped: told at
    # once, it takes every byte; with an orphan keeping the pipe open (no end of file) too.
    from horovod.runner.child_output import ChildOutput

    got: list[str] = []
    script = ("import subprocess, sys\n"
              + ("o = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'],"
                 " start_new_session=True)\nprint(f'orphan {o.pid}')\n" if orphan else "")
              + "for i in range(3000): sys.stdout.write(f'line {i:04d}\\n')\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert child.stdout is not None
    fd = os.dup(child.stdout.fileno())
    child.stdout.close()
    assert child.wait(LIMIT) == 0
    out = ChildOutput("test", [("stdout", fd, lambda lines: got.extend(t for t, _ in lines))])
    out.ended()
    t = threading.Thread(target=out.join, daemon=True)
    t.start()
    t.join(LIMIT)
    alive = _kill_orphans(got)
    assert not t.is_alive(), "the reader waited on the orphan"
    assert len(alive) == int(orphan)
    assert [g for g in got if not g.startswith("orphan")] == [f"line {i:04d}" for i in range(3000)]
