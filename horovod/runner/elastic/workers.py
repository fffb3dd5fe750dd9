"""One elastic worker process: start it (locally or over ssh, under the worker shim), forward its
output with its current rank as prefix, and report how it ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO

from horovod.common import protocol
from horovod.runner.child_output import ChildOutput
from horovod.runner.launch.commands import Command
from horovod.runner.output import prefix_line, write_line
from horovod.runner.signals import still_starting

__all__ = ["WorkerProcess"]


class WorkerProcess:
    """A started worker. ``on_exit(code, signal, record)`` is called once, from a watcher thread
    (``record``: the exit record the worker's program left, or None; see ``exit_record``)."""

    def __init__(self, cmd: Command, name: str, rank_of: Callable[[], int | None],
                 on_exit: Callable[[int | None, int | None, protocol.FailureRecord | None], None], *,
                 stdout: IO[str] | None = None, stderr: IO[str] | None = None,
                 timestamp: bool = False, write_lock: threading.Lock | None = None) -> None:
        self.cmd, self.name, self.rank_of, self.on_exit = cmd, name, rank_of, on_exit
        self.out, self.err = stdout or sys.stdout, stderr or sys.stderr
        self.timestamp = timestamp
        self.lock = write_lock or threading.Lock()
        self.exit_info: protocol.ExitReport | None = None  # the shim's exit report
        self.error_record: protocol.FailureRecord | None = None  # the rank's failure record
        self.returncode: int | None = None
        self._ended = threading.Event()  # the process ended (set before its output is drained)
        self.popen = subprocess.Popen(
            cmd.argv, env=cmd.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            stdin=subprocess.PIPE, start_new_session=True)
        assert self.popen.stdin is not None
        try:
            if cmd.stdin_data:
                self.popen.stdin.write(cmd.stdin_data)
            self.popen.stdin.flush()
        except OSError:
            pass
        pipes = []
        for stream, pipe in (("stdout", self.popen.stdout), ("stderr", self.popen.stderr)):
            assert pipe is not None
            fd = os.dup(pipe.fileno())
            pipe.close()
            pipes.append((stream, fd, self._handler(stream)))
        self.output = ChildOutput(f"elastic-{name}", pipes)
        threading.Thread(target=self._wait, daemon=True, name=f"hvd-elastic-wait-{name}").start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exit_record(self) -> protocol.FailureRecord | None:
        """The exit record of the worker's program: the one in the shim's exit report, else the
        one it sent at the moment of failure (``horovod/common/lifecycle.py``)."""
        record = self.exit_info.error if self.exit_info is not None else None
        return record if record is not None else self.error_record

    def _emit(self, stream: str, text: str, term: str) -> None:
        found = protocol.strip_markers(text, term)
        if found.error is not None and self.error_record is None:
            self.error_record = found.error
        if found.exit is not None:
            self.exit_info = found.exit
        if found.empty:
            return
        text, term = found.text, found.terminator
        line = prefix_line(self.rank_of(), stream, text, self.timestamp) + (term or "\n")
        with self.lock:
            write_line(self.err if stream == "stderr" else self.out, line)

    def _handler(self, stream: str) -> Callable[[list[tuple[str, str]]], None]:
        def handle(lines: list[tuple[str, str]]) -> None:
            for text, term in lines:
                self._emit(stream, text, term)
        return handle

    def _wait(self) -> None:
        rc = self.popen.wait()
        self._ended.set()
        # Everything the worker (and its shim's exit report) wrote is in the pipes now: the
        # verdict comes after its last line, and an orphan holding a pipe open delays nothing.
        self.output.ended()
        self.output.join()
        self.returncode = rc
        code: int | None
        sig: int | None
        info = self.exit_info
        if info is not None and (info.code is not None or info.signal is not None):
            code, sig = info.code, info.signal
        else:
            code, sig = (None, -rc) if rc < 0 else (rc, None)
        self.on_exit(code, sig, self.exit_record)

    def pass_signal(self, signum: int) -> bool:
        """Pass a signal on without stopping the worker (SIGUSR1: it prints its stacks and flight
        record, ``horovod/common/stacks.py``): through its shim, as a line on the life line of a
        remote worker, to the process group of a local one. A local worker whose shim is still
        starting is skipped (``runner/signals.py``). Returns whether the signal was passed on."""
        if self.popen.poll() is not None or still_starting(self.cmd, self.popen.pid, signum):
            return False
        stdin = self.popen.stdin
        try:
            if self.cmd.remote:
                if stdin is None or stdin.closed:
                    return False
                stdin.write(protocol.signal_line(signum))
                stdin.flush()
            else:
                os.killpg(self.popen.pid, signum)
        except (OSError, ValueError):
            return False
        return True

    def stop(self, grace: float = 5.0) -> None:
        """Ask the worker to stop (SIGTERM through the shim); SIGKILL after ``grace`` seconds."""
        if self.popen.poll() is not None:
            return
        stdin = self.popen.stdin
        try:
            if self.cmd.remote and stdin is not None and not stdin.closed:
                stdin.write(protocol.signal_line(signal.SIGTERM))
                stdin.close()
            else:
                os.killpg(self.popen.pid, signal.SIGTERM)
        except (OSError, ProcessLookupError):
            pass

        def kill_later() -> None:
            if not self._ended.wait(grace):
                self._kill_shim()

        threading.Thread(target=kill_later, daemon=True).start()

    def kill(self, grace: float = 2.0) -> None:
        """End the worker now: SIGKILL to its process group through the shim (which reaps it and
        reports its end; this reaches a remote worker, and a stopped one, too), and SIGKILL to
        the shim (or ssh) itself if it has not ended ``grace`` seconds later. Does not block."""
        if self.popen.poll() is not None:
            return
        stdin = self.popen.stdin
        try:
            if stdin is None or stdin.closed:
                raise ValueError("no life line")
            stdin.write(protocol.signal_line(signal.SIGKILL))
            stdin.close()
        except (OSError, ValueError):
            self._kill_shim()
            return

        def kill_later() -> None:
            if not self._ended.wait(grace):
                self._kill_shim()

        threading.Thread(target=kill_later, daemon=True).start()

    def _kill_shim(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass
