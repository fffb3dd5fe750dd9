"""Run the commands of a launch: stream rank-prefixed output live, stop everything on the first
failure or on Ctrl-C/SIGTERM, and collect how every rank ended (a ``JobOutcome``).

Every launcher's commands run through here alike: local shims, ssh clients, or one mpirun; the
``Supervisor`` is ``horovodrun``'s ``supervise()`` of its ``StaticSession``.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, assert_never

from horovod.common import protocol
from horovod.runner.child_output import ChildOutput
from horovod.runner.failures import RankExit, root_cause
from horovod.runner.job_outcome import JobOutcome
from horovod.runner.launch.commands import Command
from horovod.runner.output import TagParser, prefix_line, write_line
from horovod.runner.signals import still_starting

__all__ = ["Supervisor"]

log = logging.getLogger(__name__)

TAIL_LINES = 20


def _prctl() -> Any:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl  # looked up before any fork
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl() if sys.platform.startswith("linux") else None


def _still_starting(proc: _Proc, signum: int) -> bool:
    """Whether a local process has no handler for ``signum`` yet (``runner/signals.py``)."""
    return still_starting(proc.cmd, proc.popen.pid, signum)


def _end_with_launcher() -> None:
    """In mpirun, before exec: SIGTERM when horovodrun dies (killed with SIGKILL, say), so that
    mpirun stops the job instead of running on orphaned (PR_SET_PDEATHSIG)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)


def _stdin_is_tty() -> bool:
    try:
        return os.isatty(0)
    except OSError:
        return False


# What the launcher's threads tell the supervising loop (``Supervisor._events``): a shim's exit
# report seen in a rank's output, a process that ended, a signal horovodrun received.
@dataclass(frozen=True, slots=True)
class _ExitReported:
    report: protocol.ExitReport


@dataclass(frozen=True, slots=True)
class _ProcessEnded:
    index: int  # in Supervisor._procs
    returncode: int
    exit_time: float  # time.time()


@dataclass(frozen=True, slots=True)
class _SignalReceived:
    signum: int


_Event = _ExitReported | _ProcessEnded | _SignalReceived


class _Proc:
    def __init__(self, index: int, cmd: Command, popen: subprocess.Popen[bytes]) -> None:
        self.index = index
        self.cmd = cmd
        self.popen = popen
        self.returncode: int | None = None
        self.exit_time = 0.0
        self.output: ChildOutput | None = None


class Supervisor:
    """Start ``commands`` and supervise them until every one has ended.

    Args:
        commands: the processes to start.
        np: the number of ranks (for file names and checks).
        hosts_by_rank / local_rank_by_rank: from the plan, for the report.
        timestamp: put ``time.asctime()`` in front of every line.
        output_dir: also write each rank's stdout/stderr to ``DIR/rank.<r>/stdout|stderr``.
        grace_seconds: after asking the workers to stop, how long before SIGKILL.
        stdout/stderr: where prefixed lines go (default: the launcher's own).
        line_hook: called with (rank, stream, text) for every worker line (tests, horovod.run).
    """

    def __init__(self, commands: list[Command], np: int, *,
                 hosts_by_rank: dict[int, str] | None = None,
                 local_rank_by_rank: dict[int, int] | None = None,
                 timestamp: bool = False, output_dir: str | None = None,
                 grace_seconds: float = 5.0, stdout: IO[str] | None = None,
                 stderr: IO[str] | None = None,
                 line_hook: Callable[[int | None, str, str], None] | None = None) -> None:
        self.commands = commands
        self.np = np
        self.hosts_by_rank = hosts_by_rank or {}
        self.local_rank_by_rank = local_rank_by_rank or {}
        self.timestamp = timestamp
        self.output_dir = output_dir
        self.grace = grace_seconds
        self.out = stdout or sys.stdout
        self.err = stderr or sys.stderr
        self.line_hook = line_hook
        self._write_lock = threading.Lock()
        # A SimpleQueue: its put is reentrant, and the signal handler puts from the main thread
        # at any point of the loop's own get (queue.Queue's put would wait forever for the lock
        # that get holds there: a Ctrl-C that hangs horovodrun).
        self._events: queue.SimpleQueue[_Event] = queue.SimpleQueue()
        self._markers: dict[int, protocol.ExitReport] = {}  # the shims' exit reports, by rank
        self._errors: dict[int, protocol.FailureRecord] = {}  # protocol.ERROR_MARKER records, by rank
        self._tails: dict[int | None, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=TAIL_LINES))
        self._files: dict[tuple[int, str], IO[str]] = {}
        self._procs: list[_Proc] = []
        self._stopping: str | None = None
        self._kill_at: float | None = None
        self._interrupted: str | None = None

    # ----------------------------------------------------------------- output
    def _emit(self, rank: int | None, stream: str, text: str, term: str) -> None:
        found = protocol.strip_markers(text, term)
        if found.error is not None and found.error.rank is not None:
            self._errors.setdefault(found.error.rank, found.error)
        if found.exit is not None and found.exit.rank is not None:
            self._markers[found.exit.rank] = found.exit
            self._events.put(_ExitReported(found.exit))
        if found.empty:
            return
        text, term = found.text, found.terminator
        if stream == "stderr":
            self._tails[rank].append(text)
        if self.line_hook is not None:
            self.line_hook(rank, stream, text)
        line = prefix_line(rank, stream, text, self.timestamp) + (term or "\n")
        with self._write_lock:
            write_line(self.err if stream == "stderr" else self.out, line)
            if self.output_dir is not None and rank is not None:
                self._file(rank, stream).write(text + (term or "\n"))

    def _file(self, rank: int, stream: str) -> IO[str]:
        key = (rank, stream)
        if key not in self._files:
            width = len(str(max(self.np - 1, 0)))
            assert self.output_dir is not None
            d = os.path.join(self.output_dir, f"rank.{rank:0{width}d}")
            os.makedirs(d, exist_ok=True)
            self._files[key] = open(os.path.join(d, stream), "w", encoding="utf-8",  # noqa: SIM115
                                    buffering=1)
        return self._files[key]

    def _handler(self, proc: _Proc, stream: str) -> Callable[[list[tuple[str, str]]], None]:
        """What one reader of ``proc`` does with the lines of ``stream`` (on that reader's thread)."""
        tagger = TagParser(proc.cmd.tagged) if proc.cmd.tagged else None
        own_rank = proc.cmd.ranks[0] if len(proc.cmd.ranks) == 1 else None

        def handle(lines: list[tuple[str, str]]) -> None:
            for text, term in lines:
                if tagger is not None:
                    for rank, out_stream, seg, seg_term in tagger.parse(text, term, stream):
                        self._emit(rank, out_stream, seg, seg_term)
                else:
                    self._emit(own_rank, stream, text, term)

        return handle

    # -------------------------------------------------------------- processes
    def _start(self) -> None:
        for i, cmd in enumerate(self.commands):
            tagged = cmd.tagged is not None
            needs_stdin = cmd.lifeline or cmd.stdin_data is not None
            log.debug("starting %s", cmd.text())
            stdin: int | None = subprocess.PIPE if needs_stdin else None
            if tagged and _stdin_is_tty():
                # mpirun runs in a background process group (below); reading the terminal there
                # would stop it with SIGTTIN. Piped input is still passed to rank 0.
                stdin = subprocess.DEVNULL
            try:
                # Every process gets its own process group, so that a terminal's Ctrl-C reaches
                # only horovodrun, which passes it on exactly once (mpirun aborts at once on a
                # second SIGINT), and so that a worker's whole tree can be signalled. Workers
                # also get their own session, away from the terminal.
                popen = subprocess.Popen(
                    cmd.argv, env=cmd.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    stdin=stdin, start_new_session=not tagged,
                    process_group=0 if tagged else None,
                    preexec_fn=_end_with_launcher if tagged else None)
            except OSError as exc:
                self._stop(f"could not start {cmd.argv[0]!r}: {exc}")
                raise
            proc = _Proc(i, cmd, popen)
            self._procs.append(proc)
            if needs_stdin:
                assert popen.stdin is not None
                try:
                    if cmd.stdin_data:
                        popen.stdin.write(cmd.stdin_data)
                    popen.stdin.flush()
                except OSError:
                    pass
                if not cmd.lifeline:
                    popen.stdin.close()
            pipes = []
            for stream, pipe in (("stdout", popen.stdout), ("stderr", popen.stderr)):
                assert pipe is not None
                fd = os.dup(pipe.fileno())
                pipe.close()
                pipes.append((stream, fd, self._handler(proc, stream)))
            proc.output = ChildOutput(str(i), pipes)
            threading.Thread(target=self._wait, args=(proc,), daemon=True,
                             name=f"hvd-wait-{i}").start()

    def _wait(self, proc: _Proc) -> None:
        rc = proc.popen.wait()
        assert proc.output is not None
        proc.output.ended()  # its readers take what it left in the pipes and stop
        self._events.put(_ProcessEnded(proc.index, rc, time.time()))

    def _signal_proc(self, proc: _Proc, signum: int) -> None:
        if proc.returncode is not None:
            return
        try:
            if proc.cmd.tagged and signum != signal.SIGKILL:
                proc.popen.send_signal(signum)  # mpirun stops its own ranks, on every host
            else:
                os.killpg(proc.popen.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def _stop(self, reason: str, signum: int = signal.SIGTERM) -> None:
        """Ask every running process to stop; SIGKILL follows after the grace period."""
        if self._stopping is None:
            self._stopping = reason
            self._kill_at = time.monotonic() + self.grace
            log.info("stopping all workers: %s", reason)
        for proc in self._reachable(signum):
            if proc.cmd.remote:
                # The remote shim passes the signal on, then sees the life line close.
                self._close_lifeline(proc, f"signal {int(signum)}\n".encode())
            else:
                # Local shims get the signal itself; their life line stays open until the end
                # (closing it now would race the signal with a SIGTERM for the stdin EOF).
                self._signal_proc(proc, signum)

    def _reachable(self, signum: int) -> list[_Proc]:
        """The running processes a signal can be passed to now (none still starting)."""
        return [p for p in self._procs if p.returncode is None and not _still_starting(p, signum)]

    def _forward(self, signum: int) -> None:
        """Pass a signal on to every rank without stopping anything (SIGUSR1: every rank prints
        its stacks and flight record, ``horovod/common/stacks.py``)."""
        log.info("horovodrun received %s: every rank prints its stacks", signal.Signals(signum).name)
        sys.stderr.write(f"horovodrun: {signal.Signals(signum).name}: asking every rank for its stacks "
                         "and flight record (the job goes on)\n")
        sys.stderr.flush()
        for proc in self._reachable(signum):
            if proc.cmd.remote:
                stdin = proc.popen.stdin
                if proc.cmd.lifeline and stdin is not None and not stdin.closed:
                    try:
                        stdin.write(f"signal {int(signum)}\n".encode())
                        stdin.flush()
                    except OSError:
                        pass
            else:
                self._signal_proc(proc, signum)

    @staticmethod
    def _close_lifeline(proc: _Proc, last: bytes = b"") -> None:
        stdin = proc.popen.stdin
        if not proc.cmd.lifeline or stdin is None or stdin.closed:
            return
        try:
            if last:
                stdin.write(last)
            stdin.close()
        except OSError:
            pass

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._events.put(_SignalReceived(signum))

    # -------------------------------------------------------------------- run
    def run(self, handle_signals: bool = True) -> JobOutcome:
        """Start everything, supervise until all processes end, and return the result.

        SIGINT/SIGTERM received meanwhile are passed on to every worker (when called from the
        main thread and ``handle_signals``); a second one kills them at once.
        """
        old: dict[signal.Signals, Any] = {}
        if handle_signals and threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
                old[s] = signal.signal(s, self._on_signal)
        try:
            self._start()
            self._supervise()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self._late_signals()
            for proc in self._procs:
                self._close_lifeline(proc)
                if proc.returncode is None:
                    self._signal_proc(proc, signal.SIGKILL)
                    proc.returncode = proc.popen.wait()
                    proc.exit_time = time.time()
            for proc in self._procs:
                # Every process has been reaped: its last lines (and its shim's exit report) are
                # in the pipes, and taking them waits on nothing else (an orphan that inherited
                # a pipe included), however slow the machine (``runner/child_output.py``).
                if proc.output is not None:
                    proc.output.ended()
                    proc.output.join()
            for fh in self._files.values():
                fh.close()
        return self._result()

    def _late_signals(self) -> None:
        """A SIGINT/SIGTERM/SIGHUP taken by the handler after the loop's last event (every process
        had ended) still marks the job interrupted: the user's Ctrl-C is never lost (a monitor
        would otherwise linger on after it, ``monitor.finish``)."""
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            if (isinstance(event, _SignalReceived) and event.signum != signal.SIGUSR1
                    and self._interrupted is None):
                self._interrupted = signal.Signals(event.signum).name

    def _supervise(self) -> None:
        running = len(self._procs)
        failure_seen_at: float | None = None
        while running:
            event: _Event | None
            try:
                event = self._events.get(timeout=0.2)
            except queue.Empty:
                event = None
            now = time.monotonic()
            match event:
                case _ProcessEnded(index=index, returncode=returncode, exit_time=exit_time):
                    proc = self._procs[index]
                    proc.returncode, proc.exit_time = returncode, exit_time
                    running -= 1
                    if proc.returncode != 0 and self._stopping is None:
                        who = (f"rank {proc.cmd.ranks[0]} on {proc.cmd.host}"
                               if len(proc.cmd.ranks) == 1 else "mpirun")
                        self._stop(f"{who} failed")
                case _ExitReported(report=report):
                    if (report.code or report.signal) and failure_seen_at is None:
                        failure_seen_at = now
                case _SignalReceived(signum=signum) if signum == signal.SIGUSR1:
                    self._forward(signum)  # stacks on demand: the job goes on
                case _SignalReceived(signum=signum):
                    name = signal.Signals(signum).name
                    if self._interrupted is None:
                        self._interrupted = name
                        self._stop(f"horovodrun received {name}", signum)
                    else:
                        self._kill_at = now
                case None:  # nothing new: check the deadlines below
                    pass
                case _:
                    assert_never(event)
            # mpirun normally aborts the job by itself when a rank fails; make sure it does.
            if (failure_seen_at is not None and self._stopping is None
                    and now - failure_seen_at > 2 * self.grace):
                self._stop("a rank failed and mpirun did not stop the job")
            if self._kill_at is not None and now >= self._kill_at:
                for proc in self._procs:
                    self._close_lifeline(proc)
                    self._signal_proc(proc, signal.SIGKILL)
                self._kill_at = None

    # ----------------------------------------------------------------- result
    def _result(self) -> JobOutcome:
        exits: list[RankExit] = []
        seen: set[int] = set()
        for proc in self._procs:
            for rank in proc.cmd.ranks:
                info = self._markers.get(rank)
                host = self.hosts_by_rank.get(rank, proc.cmd.host)
                lr = self.local_rank_by_rank.get(rank)
                tail = list(self._tails.get(rank, []))
                if info is not None:
                    exits.append(RankExit.with_record(
                        info.error, rank, host, info.code, info.signal, info.time or proc.exit_time,
                        info.stopped_by, tail, lr))
                    seen.add(rank)
                elif len(proc.cmd.ranks) == 1 and proc.returncode is not None:
                    rc = proc.returncode
                    code, sig = (None, -rc) if rc < 0 else (rc, None)
                    note = ""
                    if proc.cmd.argv[0] == "ssh" and rc == 255:
                        note = "the ssh connection failed or the remote worker vanished"
                    elif rc != 0:
                        note = "no exit report from the worker"
                    stopped = self._stopping if (self._stopping and rc != 0 and
                                                 proc.exit_time > 0 and
                                                 not self._was_first(proc)) else None
                    exits.append(RankExit(rank, host, code, sig, proc.exit_time, stopped, tail,
                                          lr, note))
                    seen.add(rank)
        # mpirun stops forwarding output once it terminates a job, so ranks it stopped may never
        # deliver their exit report; they are listed as stopped by mpirun.
        if any(e.failed for e in exits):
            for proc in self._procs:
                if proc.cmd.tagged and proc.returncode:
                    for rank in proc.cmd.ranks:
                        if rank not in seen:
                            exits.append(RankExit(
                                rank, self.hosts_by_rank.get(rank, proc.cmd.host), None, None,
                                proc.exit_time, "by mpirun; its exit report was not forwarded",
                                list(self._tails.get(rank, [])),
                                self.local_rank_by_rank.get(rank)))
        for e in exits:  # the record sent at the moment of failure, when the shim had none
            if e.error_kind is None and e.rank is not None and e.rank in self._errors:
                e.apply_record(self._errors[e.rank])
        returncode = 0
        launcher_tail = list(self._tails.get(None, []))
        mpirun = [p for p in self._procs if len(p.cmd.ranks) != 1 or p.cmd.tagged]
        first = root_cause(exits)
        if first is not None:
            returncode = first.exit_status or 1
        for proc in mpirun:
            if proc.returncode and first is None:
                rc = proc.returncode
                code, sig = (None, -rc) if rc < 0 else (rc, None)
                exits.append(RankExit(None, proc.cmd.host, code, sig, proc.exit_time,
                                      self._stopping if self._interrupted else None,
                                      launcher_tail, None, "mpirun failed before any rank reported"))
                returncode = rc if rc > 0 else 128 - rc
        if self._interrupted and returncode == 0:
            returncode = 128 + signal.Signals[self._interrupted].value
        elif self._interrupted and (first is None or first.stopped_by):
            returncode = 128 + signal.Signals[self._interrupted].value
        return JobOutcome(exits, returncode, interrupted=self._interrupted, launcher_tail=launcher_tail)

    def _was_first(self, proc: _Proc) -> bool:
        failed = [p for p in self._procs if p.returncode not in (None, 0)]
        return bool(failed) and min(failed, key=lambda p: p.exit_time) is proc
