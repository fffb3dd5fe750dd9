"""Worker shim: run one rank's command, stop its process tree on demand, and report how it ended.

Run by file path (standard library only; the package ``horovod`` is not imported) as::

    python -u _shim.py [--watch-stdin] [--stdin-env] -- command args...

* ``--stdin-env``: the first stdin line is the worker's environment (``protocol.env_line``),
  merged into the environment (how ssh-started workers get their variables and the job secret
  without a command line).
* ``--watch-stdin``: stdin is the launcher's life line; when it closes, the worker's process group
  is sent SIGTERM, then SIGKILL after a grace period. A line ``signal <N>`` sends signal N first
  (SIGUSR1 and SIGUSR2 are only passed on: SIGUSR1 asks the rank for its stacks).
  Without it (under mpirun) the shim stops the worker when its own parent dies.

The command runs in its own process group. SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 are passed
on to that group. When the command ends, the rest of its group is stopped and one line
``__HOROVOD_RUNNER_EXIT__ {json}`` goes to stderr (spelled in ``horovod/common/protocol/``, which the
shim loads by its path): rank, host, pid, exit code or signal, time, and
why the shim stopped it, if it did. The command finds a file name in ``HOROVOD_EXIT_RECORD``;
Horovod writes there, the moment a rank fails, whether its error is a cause of its own or only
the consequence of a peer leaving (``horovod/common/lifecycle.py``), and the shim passes that on
as ``"error"``. The launcher removes that line from the output and uses it
for the failure report. The shim exits with the command's code, or 128 + the signal number.
"""

from __future__ import annotations

import signal

if __name__ == "__main__":
    # First of all: a SIGUSR1 that horovodrun passes on (stacks on demand) while this shim is
    # still starting must not kill it (main() then passes SIGUSR1 on to the command).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)

import importlib.util  # noqa: E402
import json
import os
import socket
import subprocess
import sys
import threading
import time
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the shim loads the least it can: it starts before every rank
    from collections.abc import Mapping


def _load_protocol() -> ModuleType:
    """``horovod/common/protocol/`` (the protocol, standard library only), loaded by its path."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "common", "protocol")
    spec = importlib.util.spec_from_file_location("_horovod_protocol", os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its submodules and dataclasses look the package up by name
    spec.loader.exec_module(module)
    return module


protocol = _load_protocol()
MARKER = protocol.EXIT_MARKER
EXIT_RECORD_ENV = protocol.EXIT_RECORD_ENV
GRACE_SECONDS = 3.0


def _set_parent_death_signal() -> None:
    """Have the kernel SIGKILL the command if this shim dies first (Linux only)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort, not available everywhere
        pass


def _prepare_child() -> None:
    """In the command's process, before exec: die with the shim, and ignore SIGUSR1 until
    ``hvd.init()`` makes it print the rank's stacks (``horovod/common/stacks.py``): a SIGUSR1
    that horovodrun passes on while the rank is still starting must not kill it."""
    _set_parent_death_signal()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


class _Stopper:
    def __init__(self, pgid: int) -> None:
        self.pgid = pgid
        self.reason: str | None = None
        self.lock = threading.Lock()

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.pgid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, reason: str, signum: int = signal.SIGTERM) -> None:
        """Send ``signum`` to the worker's group once; SIGKILL follows after the grace period.

        Only the first request counts: a life line closing right after a forwarded SIGINT must
        not turn into a SIGTERM that overtakes it; a SIGKILL is always sent.
        """
        with self.lock:
            if self.reason is not None:
                if signum == signal.SIGKILL:  # "now" overrides an earlier polite request
                    self.signal_group(signum)
                return
            self.reason = reason
        self.signal_group(signum)
        t = threading.Timer(GRACE_SECONDS, self.signal_group, args=(signal.SIGKILL,))
        t.daemon = True
        t.start()


def _watch_stdin(stopper: _Stopper) -> None:
    # The launcher may send "signal <N>" lines (Ctrl-C reaching remote workers) before closing.
    try:
        for line in sys.stdin.buffer:
            signum = protocol.parse_signal_line(line)
            if signum in (signal.SIGUSR1, signal.SIGUSR2):  # passed on; the job goes on
                stopper.signal_group(signum)
            elif signum is not None:
                stopper.stop(f"horovodrun sent {signal.Signals(signum).name}", signum)
    except (OSError, ValueError):
        pass
    stopper.stop("horovodrun closed the connection (job stopping)")


def _watch_parent(stopper: _Stopper, parent: int) -> None:
    while True:
        if os.getppid() != parent:
            stopper.stop("the process that started this worker died")
            return
        time.sleep(0.5)


def _orphaned_at_start(parent: int, environ: Mapping[str, str], hostname: str) -> bool:
    """Whether the process that started this shim died before the shim could note its pid (on a
    loaded host the interpreter's start takes seconds; a horovodrun killed then takes mpirun with
    it, and the shim would start its command for nobody): the shim was handed to init (pid 1), or
    Open MPI's ``mpirun`` on this host started it (``environ``: mpirun's, given with ``--mpirun``;
    its ``PMIX_NAMESPACE`` is ``prterun-<host>-<pid>@<job>``, and mpirun starts this host's ranks
    itself) and the parent is another process (a subreaper's)."""
    if parent == 1:
        return True
    launcher, _, job = environ.get("PMIX_NAMESPACE", "").partition("@")
    if not launcher.startswith("prterun-") or not job:
        return False
    host, _, pid = launcher[len("prterun-"):].rpartition("-")
    return host == hostname and pid.isdigit() and int(pid) != parent


def main(argv: list[str]) -> int:
    parent = os.getppid()  # first: the earlier noted, the shorter the window for a parent to die unseen
    watch_stdin = stdin_env = under_mpirun = False
    while argv and argv[0] != "--":
        flag = argv.pop(0)
        if flag == "--watch-stdin":
            watch_stdin = True
        elif flag == "--stdin-env":
            stdin_env = True
        elif flag == "--mpirun":
            under_mpirun = True
        else:
            sys.stderr.write(f"horovod shim: unknown option {flag}\n")
            return 2
    command = argv[1:]
    if not command:
        sys.stderr.write("horovod shim: no command given\n")
        return 2
    env = dict(os.environ)
    if stdin_env:
        line = sys.stdin.buffer.readline()
        try:
            env.update(protocol.parse_env_line(line))
        except ValueError as exc:
            sys.stderr.write(f"horovod shim: bad environment line from the launcher: {exc}\n")
            return 2
    rank = protocol.env_rank(env) or "?"
    host = env.get("HOROVOD_HOSTNAME") or socket.gethostname()
    if not watch_stdin and _orphaned_at_start(parent, os.environ if under_mpirun else {},
                                              socket.gethostname()):
        sys.stderr.write(f"horovod shim: rank {rank} on {host}: the process that started this worker "
                         "had already died; not starting the command\n")
        return 1

    record_path = os.path.join(os.environ.get("TMPDIR") or "/tmp",
                               f"horovod-exit-{os.getpid()}-{time.time_ns()}.json")
    try:
        os.close(os.open(record_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        env[EXIT_RECORD_ENV] = record_path
    except OSError:  # no record then; the rank's error marker on stderr still reaches the launcher
        pass

    def read_record() -> Any:
        try:
            with open(record_path, encoding="utf-8") as fh:
                text = fh.read()
            return protocol.FailureRecord.from_wire(json.loads(text)) if text.strip() else None
        except (OSError, ValueError):
            return None
        finally:
            try:
                os.unlink(record_path)
            except OSError:
                pass

    def report(code: int | None, signum: int | None, reason: str | None) -> None:
        info = protocol.ExitReport(int(rank) if rank.isdigit() else None, host, child_pid, code, signum,
                                   time.time(), reason, read_record(), socket.gethostname())
        sys.stdout.flush()
        sys.stderr.write(protocol.exit_line(info))
        sys.stderr.flush()

    child_pid = None
    try:
        child = subprocess.Popen(command, env=env, close_fds=False, process_group=0,
                                 stdin=subprocess.DEVNULL if (watch_stdin or stdin_env) else None,
                                 preexec_fn=_prepare_child)
    except OSError as exc:
        sys.stderr.write(f"horovodrun: rank {rank} on {host}: cannot start {command[0]!r}: "
                         f"{exc.strerror or exc}\n")
        report(127, None, None)
        return 127
    child_pid = child.pid
    stopper = _Stopper(child.pid)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if signum in (signal.SIGUSR1, signal.SIGUSR2):
            stopper.signal_group(signum)
        else:
            stopper.stop(f"received {signal.Signals(signum).name}", signum)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, on_signal)
    if watch_stdin:
        threading.Thread(target=_watch_stdin, args=(stopper,), daemon=True).start()
    else:
        threading.Thread(target=_watch_parent, args=(stopper, parent), daemon=True).start()

    status = child.wait()
    # Whatever the command left running in its group (data loader workers, ...) goes with it.
    stopper.signal_group(signal.SIGTERM)
    if status < 0:
        report(None, -status, stopper.reason)
        return 128 - status
    report(status, None, stopper.reason)
    return status


if __name__ == "__main__":
    status = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: a watcher thread may be blocked reading stdin, which would make a normal
    # interpreter shutdown abort on the stdin buffer's lock.
    os._exit(status)
