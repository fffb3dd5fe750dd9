"""How a Horovod process ends: MPI started and stopped by us when asked, failures never wait.

* ``mpi4py.rc.initialize = False`` (upstream's way of letting Horovod own MPI): the MPI backend
  calls ``MPI.Init_thread`` and :func:`note_mpi_initialized` records it; MPI is then finalized
  here at exit, and only then (never when mpi4py or the user initialized it).
* A rank that ends with an uncaught exception or a non-zero ``sys.exit()`` must not wait for its
  peers on the way out: Open MPI 5's ``MPI_Finalize`` waits for every peer, so a rank that fails
  while another computes would stay "running" until that one reaches finalize too. After
  ``hvd.init()`` in a job of more than one rank, such a rank leaves at once with its exit code
  (``os._exit`` after flushing output and logging), skipping finalize; mpirun or horovodrun see
  a non-zero exit and stop the job.
* Python tells no one how a process ends (an uncaught ``SystemExit`` leaves no trace an ``atexit``
  function could read), so this takes one process-wide hook, **the fail-fast hook**: it wraps
  ``sys.excepthook`` (the previous hook still runs) and makes ``sys.exit``/``exit``/``quit`` raise
  a ``SystemExit`` subclass that notices when it ends the process (its finalizer runs with no
  Python frame left only when the exit was not caught: Python 3.11 offers no other sign).
  ``hvd.init()`` installs it only in a worker of a launched job (more than one rank, or started by
  ``horovodrun``) and ``hvd.shutdown()`` removes it (``uninstall``); never in a single process of
  its own (a notebook, ``python train.py``, a unit test), and not at all when
  ``HOROVOD_FAIL_FAST=0``: a failed rank then takes the normal exit path (MPI's finalize may
  wait for its peers until the launcher stops them).
* The failure is classified: a ``HorovodShutdownError`` or a plain ``HorovodInternalError``
  (raised because a peer left) is a *consequence*; anything else is a *cause*. When the launcher
  names a file in ``HOROVOD_EXIT_RECORD`` the record (``protocol.FailureRecord``) is
  written there the moment the failure is seen (before any exit work that could hang), so the
  failure report names the rank whose error started it, whatever order the ranks ended in.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from types import TracebackType
from typing import Any, NoReturn

from horovod.common import protocol
from horovod.common.exceptions import HorovodInternalError, HorovodShutdownError

__all__ = ["EXIT_RECORD_ENV", "ERROR_MARKER", "Failure", "classify", "failure", "install", "installed", "uninstall",
           "wanted",
           "note_mpi_initialized",
           "note_multi_rank", "record_failure", "end_process"]

EXIT_RECORD_ENV = protocol.EXIT_RECORD_ENV
# The same record, as one stderr line the launcher removes from the output: it travels with the
# rank's output at once, so the launcher has it even when mpirun stops the rank before its shim
# can report (mpirun stops forwarding a job's output once it terminates it).
ERROR_MARKER = protocol.ERROR_MARKER

log = logging.getLogger("horovod")


# Why this process is ending badly: its exit code, cause or consequence, the error, and when.
Failure = protocol.FailureRecord


_failure: Failure | None = None
_waiting = ""  # the first collective this process saw fail ("broadcast 'name'")
_mpi_initialized_here = False
_multi_rank = False
_rank_size: tuple[int, int | None] | None = None
_installed = False


def failure() -> Failure | None:
    return _failure


def note_failed_wait(kind: str, name: str) -> None:
    """A collective this process waited in failed (``Handle.wait``): named in its exit record
    when its failure is the consequence of a peer leaving."""
    global _waiting
    if not _waiting:
        if name.startswith(kind + "."):  # the engine's name of an unnamed or prefixed op
            name = name[len(kind) + 1:]
        _waiting = f"{kind} {name!r}"


def _write_record(record: Failure) -> None:
    """The launcher's exit record: the file its shim named, and the stderr marker line."""
    path = os.environ.get(EXIT_RECORD_ENV)
    if not path:
        return
    with contextlib.suppress(OSError):
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(record.to_wire(), fh)
    rank = protocol.env_rank() or ""
    if rank.isdigit():
        line = protocol.error_line(replace(record, rank=int(rank)))
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        with contextlib.suppress(OSError):
            os.write(2, line.encode("utf-8"))


def record_finished() -> None:
    """This rank's program ended normally: say so (and when) in its exit record, before any exit
    work that may wait for peers, so that peers still waiting in a collective for it report it
    as having left early (``horovod.runner.failures.root_cause``)."""
    if _failure is None and _multi_rank:
        _write_record(Failure(0, "finished", "its program ended normally", time.time()))


def note_mpi_initialized() -> None:
    """The MPI backend called ``MPI.Init_thread`` itself (mpi4py was told not to)."""
    global _mpi_initialized_here
    _mpi_initialized_here = True


def note_multi_rank(rank: int | None = None, size: int | None = None) -> None:
    """This process belongs to a job of more than one rank (a failure must not wait for peers).

    ``rank``/``size`` name it in the line a failure prints when no Horovod launcher collects the
    failure record (``srun``, ``torchrun``, a bare ``mpirun``).
    """
    global _multi_rank, _rank_size
    _multi_rank = True
    if rank is not None:
        _rank_size = (rank, size)


def _is_consequence_type(exc: BaseException) -> bool:
    return isinstance(exc, HorovodShutdownError) or type(exc) is HorovodInternalError


def _below(exc: BaseException) -> BaseException | None:
    return exc.__cause__ or exc.__context__


def classify(exc: BaseException | None) -> str:
    """``"consequence"`` when the error only says that a peer left, else ``"cause"``.

    Follows the chain of ``raise ... from``/``during handling``: the first ``HorovodShutdownError``
    or plain ``HorovodInternalError`` (a collective failed in the transport) in it makes it a
    consequence, unless the engine stopped because of an exception of this rank's own (a
    ``HorovodShutdownError`` raised from, say, a ``RuntimeError`` of the program).
    """
    return _classify(exc)[0]


def _classify(exc: BaseException | None) -> tuple[str, BaseException | None]:
    """The kind, and the exception that best says what happened (shown in the report)."""
    top = exc
    seen: set[int] = set()
    while exc is not None and not _is_consequence_type(exc) and id(exc) not in seen:
        seen.add(id(exc))
        exc = _below(exc)
    if exc is None or id(exc) in seen:
        return "cause", top  # no Horovod error in the chain: the program's own
    last = exc
    while (nxt := _below(last)) is not None and _is_consequence_type(nxt) and id(nxt) not in seen:
        seen.add(id(nxt))
        last = nxt
    below = _below(last)
    if below is None or (type(last) is HorovodInternalError and not _raised_by_program(below)):
        return "consequence", top  # a peer left, or the transport failed under us
    return "cause", below  # the engine stopped because this rank's program raised


_LIBRARY_PARTS = (os.sep + "torch" + os.sep, os.sep + "mpi4py" + os.sep)


def _raised_by_program(exc: BaseException) -> bool:
    """Whether ``exc`` was raised in the program's own code (a signal handler, a callback) rather
    than in Horovod or a transport library (Gloo raises plain ``RuntimeError``)."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    path = os.path.abspath(tb.tb_frame.f_code.co_filename)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../horovod
    return not path.startswith(package + os.sep) and not any(p in path for p in _LIBRARY_PARTS)


def record_failure(code: int, kind: str, error: str) -> None:
    """Remember the first failure and write the launcher's exit record at once."""
    global _failure
    if _failure is not None or code == 0:
        return
    _failure = Failure(code, kind, error, time.time(), waiting=_waiting if kind == "consequence" else "")
    if os.environ.get(EXIT_RECORD_ENV):  # started by horovodrun (its worker shim named the file)
        _write_record(_failure)
    elif _multi_rank and _rank_size is not None:
        # No Horovod launcher will name the rank that ended the job: say it here, one line.
        me, size = _rank_size
        of = f" of {size}" if size else ""
        line = (f"horovod: rank {me}{of} failed, ending the job: {error}" if kind == "cause" else
                f"horovod: rank {me}{of} stops because another rank failed or left ({error})")
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        with contextlib.suppress(OSError):
            os.write(2, (line.splitlines()[0][:600] + "\n").encode("utf-8", "replace"))


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1  # a message: Python prints it and exits with 1


def _summary(exc: BaseException) -> str:
    """The exception as one short text: its first line and its end when it is long (a stall
    report says what it is first and sums up last)."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    if len(text) <= 500:
        return text
    first = text.splitlines()[0][:200]
    return f"{first}\n...\n{text[-(495 - len(first)):]}"


class _ExitRequest(SystemExit):
    """``sys.exit()`` after ``hvd.init()``: tells whether it ended the process or was caught.

    When it reaches the top level, Python clears it with no Python frame running; its finalizer
    then sees no caller. Caught by the program, it is released while a frame still runs.
    """

    def __del__(self) -> None:
        if sys.is_finalizing():  # freed with the modules at the very end: says nothing
            return
        try:
            sys._getframe(1)
        except ValueError:
            code = _exit_code(self.code)
            if code:
                record_failure(code, "cause", f"sys.exit({self.code!r})")


def _exit_request(status: Any) -> _ExitRequest:
    return _ExitRequest(status)


def _sys_exit(status: Any = None) -> NoReturn:
    # made in a helper: a local name here would tie the exception to its own traceback (a
    # cycle) and keep it alive, so that its finalizer would not run when it ends the process
    raise _exit_request(status)


def _excepthook(orig: Callable[..., Any]) -> Callable[..., Any]:
    def hook(etype: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        code = 130 if issubclass(etype, KeyboardInterrupt) else 1
        kind, shown = _classify(value)
        record_failure(code, kind, _summary(shown or value))
        orig(etype, value, tb)
    hook._horovod = True  # type: ignore[attr-defined]
    return hook


def wanted(size: int) -> bool:
    """Whether ``hvd.init()`` installs the fail-fast hook in a job of ``size`` ranks (see above)."""
    if os.environ.get(protocol.LIFECYCLE_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    return size > 1 or protocol.EXIT_RECORD_ENV in os.environ


def installed() -> bool:
    return _installed


# What ``install`` replaced, restored by ``uninstall``: (module, attribute, original, ours).
_replaced: list[tuple[Any, str, Any, Any]] = []


def install() -> None:
    """Install the fail-fast hook (called by ``hvd.init()`` when :func:`wanted`; idempotent).

    ``uninstall`` (called by ``hvd.shutdown()``) puts back what it replaced."""
    global _installed
    if _installed:
        return
    _installed = True
    _replace(sys, "excepthook", _excepthook(sys.excepthook))
    _replace(sys, "exit", _sys_exit)
    quitter = getattr(builtins, "exit", None)
    if quitter is not None and type(quitter).__name__ == "Quitter":
        base: Any = type(quitter)

        class _Quitter(base):  # type: ignore[misc, valid-type]
            def __call__(self, code: Any = None) -> None:
                with contextlib.suppress(Exception):
                    sys.stdin.close()
                raise _exit_request(code)

        _replace(builtins, "exit", _Quitter("exit", "Ctrl-D (i.e. EOF)"))
        _replace(builtins, "quit", _Quitter("quit", "Ctrl-D (i.e. EOF)"))


def _replace(module: Any, attr: str, ours: Any) -> None:
    _replaced.append((module, attr, getattr(module, attr, None), ours))
    setattr(module, attr, ours)


def uninstall() -> None:
    """Remove the fail-fast hook (``hvd.shutdown()``): ``sys.excepthook``, ``sys.exit``, ``exit``
    and ``quit`` are what they were before ``install``, unless someone replaced ours since (then
    theirs stays). A failure already recorded still decides how the process ends."""
    global _installed
    while _replaced:
        module, attr, original, ours = _replaced.pop()
        if getattr(module, attr, None) is ours:
            setattr(module, attr, original)
    _installed = False


def _finalize_mpi() -> None:
    if not _mpi_initialized_here or "mpi4py.MPI" not in sys.modules:
        return
    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def end_process(shutdown: Callable[[], None]) -> None:
    """The ``atexit`` step of a process that called ``hvd.init()``.

    Normally: shut Horovod down, then finalize MPI if Horovod initialized it. After a failure in
    a job of several ranks: flush output and leave with the failure's exit code at once.
    """
    fail = _failure
    if fail is not None and _multi_rank:
        with contextlib.suppress(Exception):
            log.debug("leaving with exit code %d without waiting for peers (%s)", fail.code,
                      fail.error)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        with contextlib.suppress(Exception):
            logging.shutdown()
        os._exit(fail.code or 1)
    record_finished()
    shutdown()
    _finalize_mpi()
