"""Stacks on demand: SIGUSR1 makes a rank print every thread's stack and its flight record.

Python's ``faulthandler`` convention: ``kill -USR1`` a process to see where it is, without
stopping it. ``horovodrun`` passes a SIGUSR1 it receives on to every rank (``runner/launch/supervisor.py``,
the worker shim), so ``kill -USR1 <horovodrun's pid>`` prints every rank's stacks, each line under
its rank's prefix, and the job runs on.

``hvd.init()`` installs this (``install``) unless the program has its own SIGUSR1 handler;
``hvd.shutdown()`` removes it (``uninstall``). A worker that horovodrun starts ignores SIGUSR1
until then (its shim sets that before running it), so a SIGUSR1 during start-up harms nothing.
The signal is caught by ``faulthandler`` in C, so
it is taken at once whatever the main thread does (blocked in a lock, in MPI, in C code); its
raw dump goes into a pipe whose reader, a daemon thread, then writes the readable report to
stderr: the main thread first, each stack most recent call last, and the flight record (the last
completed collectives and those in flight, ``engine/flight.py``). A rank whose main thread holds
the GIL without releasing it prints once it lets go.

``all_stacks()`` (rank 0) collects the same from every rank through the engine's rounds.
"""

from __future__ import annotations

import faulthandler
import os
import select
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from horovod.common.engine.diagnosis import format_stack, thread_stacks
from horovod.common.engine.flight import format_record

__all__ = ["install", "uninstall", "installed", "report", "all_stacks", "format_answer"]

DUMP_DONE = 32  # completed collectives shown per dump


class _Dumper:
    def __init__(self, describe: Callable[[], str], record: Callable[[], dict[str, Any]]) -> None:
        self.describe = describe
        self.record = record
        self.read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # a full pipe must never block the signal handler
        self.writer = os.fdopen(write_fd, "wb", buffering=0)
        faulthandler.register(signal.SIGUSR1, file=self.writer, all_threads=True, chain=False)
        self.thread = threading.Thread(target=self._run, name="horovod-stacks", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self.read_fd, 1 << 16)
            except OSError:
                return
            if not data:
                return
            # faulthandler writes its dump in many small pieces: take them all as one request.
            while select.select([self.read_fd], [], [], 0.1)[0]:
                try:
                    if not os.read(self.read_fd, 1 << 16):
                        return
                except OSError:
                    return
            try:
                text = report(self.describe(), self.record())
            except Exception as exc:  # noqa: BLE001 - a dump must never break the rank
                text = f"horovod: stacks on demand failed: {exc!r}\n"
            try:
                sys.stderr.write(text)
                sys.stderr.flush()
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        faulthandler.unregister(signal.SIGUSR1)
        self.writer.close()  # the reader sees the end of the pipe
        if self.thread is not threading.current_thread():
            self.thread.join(2.0)
        try:
            os.close(self.read_fd)
        except OSError:
            pass


_dumper: _Dumper | None = None


def installed() -> bool:
    return _dumper is not None


def install(describe: Callable[[], str], record: Callable[[], dict[str, Any]]) -> bool:
    """Print stacks and ``record()`` on SIGUSR1 (``describe()``: who this rank is). False when the
    program handles SIGUSR1 itself or this is not the main thread (then nothing is installed)."""
    global _dumper
    if _dumper is not None:
        uninstall()
    if not hasattr(signal, "SIGUSR1") or threading.current_thread() is not threading.main_thread():
        return False
    # The default action (terminate), or ignored (a worker horovodrun started: its shim ignores
    # SIGUSR1 until now): replaced; a handler of the program's own: kept.
    if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, signal.SIG_IGN, None):
        return False
    _dumper = _Dumper(describe, record)
    return True


def uninstall() -> None:
    """Remove what ``install`` set up (SIGUSR1 back to its default action)."""
    global _dumper
    dumper, _dumper = _dumper, None
    if dumper is not None:
        dumper.close()


def report(who: str, record: dict[str, Any]) -> str:
    """This process's stacks (every thread, the main one first) and flight record, as text."""
    lines = [f"horovod: {who}: stacks on demand (SIGUSR1); the job goes on"]
    for name, stack in thread_stacks():
        if name == "horovod-stacks":
            continue
        if name.startswith("horovod-") and stack:  # Horovod's own threads: where, in one line
            path, line, func, _ = stack[-1]
            lines.append(f"Thread {name!r}: in {func} ({os.path.basename(str(path))}:{line})")
            continue
        lines.append(f"Thread {name!r} (most recent call last):")
        lines.extend(format_stack(stack, "  "))
    lines.append("Flight record (completed, then in flight):")
    lines.extend(format_record(record, "  "))
    return "\n".join(lines) + "\n"


def format_answer(answer: dict[str, Any]) -> str:
    """One rank's answer to ``all_stacks`` as text."""
    lines = [f"rank {answer['rank']} (host {answer['host']}, pid {answer['pid']}): main thread in "
             f"{answer['where']} (most recent call last):"]
    lines.extend(format_stack(answer.get("stack"), "  "))
    lines.append("Flight record (completed, then in flight):")
    lines.extend(format_record(answer, "  "))
    return "\n".join(lines)


def all_stacks(timeout: float = 10.0) -> dict[int, str]:
    """Every rank's main-thread stack and flight record, by rank (call on rank 0, any thread that
    is not waiting on a collective; the other ranks need not call anything). Ranks answer from
    their engine's thread, so a rank stuck in user code answers too.

    Raises:
        RuntimeError: not rank 0, or the ranks did not answer within ``timeout`` seconds.
    """
    from horovod.common.context import get_context

    engine = get_context()._engine()
    answers = engine.stall.ask_stacks(timeout)
    if not answers:
        raise RuntimeError(f"the ranks did not answer within {timeout:g} s (a rank is stopped, "
                           "holds the GIL, or the engine is not running rounds)")
    return {r: format_answer(a) for r, a in sorted(answers.items())}
