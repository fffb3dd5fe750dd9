"""Stacks on demand in an elastic job (issue 45): SIGUSR1 to an elastic horovodrun is passed on to
every live worker through its shim (locally, or over ssh as a line on its life line), each prints
its stacks and flight record under its rank's prefix, and the job goes on.

Every worker blocks before a chosen step in ``blocked_until_released`` (``BLOCK_AT`` of
``bin/elastic_worker.py``), reading a FIFO of its own; once every worker has said READY from
there, the test sends SIGUSR1 to horovodrun, waits (bounded) until every rank's dump with that
frame has come, and only then writes the FIFOs: no sleep orders anything. The job must then
finish with rc 0 and exactly the trained weights.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests._fakehosts import FakeHosts
from tests.elastic.conftest import check_training, run_elastic

pytestmark = pytest.mark.integration

BLOCK_STEP = 3
# Every rank's stack within 5 s of the signal is the goal; generous for a loaded 2-core machine.
DUMP_BOUND = 20.0
FRAME = re.compile(r"^\[(\d+)\]<stderr>:  File \"[^\"]*elastic_worker\.py\", line \d+, in "
                   r"blocked_until_released$")


class StacksOnDemand:
    """Sends SIGUSR1 once every worker is READY; releases the workers once every rank's dump
    showed the blocking frame, or after ``DUMP_BOUND`` seconds (then the test fails)."""

    def __init__(self, fifo_dir: Path, workers: list[str]) -> None:
        self.fifo_dir, self.workers = fifo_dir, workers
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[str] | None = None
        self.ready: set[str] = set()
        self.headers: set[int] = set()
        self.frames: set[int] = set()
        self.sent_at: float | None = None
        self.all_at: float | None = None
        self.released = False
        for me in workers:
            os.mkfifo(fifo_dir / me)

    def popen(self, start: Callable[..., Any]) -> Callable[..., Any]:
        def started(argv: list[str], **kw: Any) -> Any:
            self.proc = start(argv, **kw)
            return self.proc
        return started

    def on_stdout(self, line: str) -> None:
        m = re.search(r"<stdout>:READY (\S+) rank \d+$", line.rstrip("\n"))
        if not m:
            return
        with self.lock:
            self.ready.add(m.group(1))
            if len(self.ready) < len(self.workers) or self.sent_at is not None:
                return
            self.sent_at = time.monotonic()
            assert self.proc is not None
            self.proc.send_signal(signal.SIGUSR1)
        timer = threading.Timer(DUMP_BOUND, self.release)
        timer.daemon = True
        timer.start()

    def on_stderr(self, line: str) -> None:
        line = line.rstrip("\n")
        with self.lock:
            if self.sent_at is None:
                return
            m = re.match(r"\[(\d+)\]<stderr>:horovod: rank (\d+) .*: stacks on demand \(SIGUSR1\)", line)
            if m and m.group(1) == m.group(2):
                self.headers.add(int(m.group(1)))
            m = FRAME.match(line)
            if m:
                self.frames.add(int(m.group(1)))
            done = (self.all_at is None and self.headers == set(range(len(self.workers)))
                    and self.frames == self.headers)
            if done:
                self.all_at = time.monotonic()
        if done:
            self.release()

    def release(self) -> None:
        with self.lock:
            if self.released:
                return
            self.released = True
        for me in self.workers:  # a writer per FIFO: open() waits for its reader
            threading.Thread(target=lambda m=me: (self.fifo_dir / m).write_bytes(b"go"),
                             daemon=True).start()


def _check_stacks_on_demand(tmp_path: Path, hosts: str, workers: list[str], start: Callable[..., Any],
                            timeout: float = 150) -> None:
    steps = 8
    fifo_dir = tmp_path / "release"
    fifo_dir.mkdir()
    watch = StacksOnDemand(fifo_dir, workers)
    n = str(len(workers))
    res, _ = run_elastic(
        tmp_path, hosts, ["-np", n, "--min-np", n, "--max-np", n],
        {"STEPS": str(steps), "BLOCK_AT": f"{BLOCK_STEP}@{fifo_dir}"}, timeout=timeout,
        popen=watch.popen(start), on_stdout=watch.on_stdout, on_stderr=watch.on_stderr)
    out = res.stdout + res.stderr
    assert watch.sent_at is not None, f"the workers never said READY:\n{out[-4000:]}"
    assert watch.ready == set(workers), watch.ready
    assert f"horovodrun: SIGUSR1: asking every worker ({n} running) for its stacks and flight " \
           "record (the job goes on)" in res.stderr, res.stderr[-4000:]
    assert watch.all_at is not None, (
        f"not every rank's stack in blocked_until_released within {DUMP_BOUND} s of SIGUSR1 "
        f"(dumps from ranks {sorted(watch.headers)}, frame from {sorted(watch.frames)}):\n{out[-6000:]}")
    assert watch.all_at - watch.sent_at < DUMP_BOUND
    for r in range(len(workers)):  # each dump carries the rank's flight record
        assert re.search(rf"^\[{r}\]<stderr>:Flight record \(completed, then in flight\):$", res.stderr,
                         re.M), res.stderr[-4000:]
    finals = check_training(res, steps, size=len(workers))  # rc 0, every step once, exact weights
    assert {f["me"] for f in finals} == set(workers)
    assert "still starting" not in res.stderr


def test_sigusr1_prints_every_ranks_stack_and_the_job_goes_on(tmp_path: Path) -> None:
    _check_stacks_on_demand(tmp_path, "localhost:2\n", ["localhost[0]", "localhost[1]"],
                            subprocess.Popen)


@pytest.mark.fakehosts
def test_sigusr1_reaches_a_worker_over_ssh(fakehosts_factory: Callable[..., FakeHosts],
                                           tmp_path: Path) -> None:
    # horovodrun inside the first host: its worker there is local, the other's runs over ssh and
    # gets the signal as a line on its life line.
    fh = fakehosts_factory(2)
    h1, h2 = fh.hosts
    _check_stacks_on_demand(tmp_path, f"{h1}:1\n{h2}:1\n", [f"{h1}[0]", f"{h2}[0]"],
                            lambda argv, **kw: fh.popen(h1, argv, **kw), timeout=240)
