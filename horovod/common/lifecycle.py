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
* The failure is classified: a ``HorovodShutdownError`` or a plain ``HorovodInternalError``
  (raised because a peer left) is a *consequence*; anything else is a *cause*. When the launcher
  names a file in ``HOROVOD_EXIT_RECORD`` the record ``{"code", "kind", "error", "time"}`` is
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
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any, NoReturn

from horovod.common.exceptions import HorovodInternalError, HorovodShutdownError

__all__ = ["EXIT_RECORD_ENV", "Failure", "classify", "failure", "install", "note_mpi_initialized",
           "note_multi_rank", "record_failure", "end_process"]

EXIT_RECORD_ENV = "HOROVOD_EXIT_RECORD"

log = logging.getLogger("horovod")


@dataclass(frozen=True)
class Failure:
    """Why this process is ending badly: its exit code, cause or consequence, and the error."""

    code: int
    kind: str  # "cause" | "consequence"
    error: str
    time: float


_failure: Failure | None = None
_mpi_initialized_here = False
_multi_rank = False
_installed = False


def failure() -> Failure | None:
    return _failure


def note_mpi_initialized() -> None:
    """The MPI backend called ``MPI.Init_thread`` itself (mpi4py was told not to)."""
    global _mpi_initialized_here
    _mpi_initialized_here = True


def note_multi_rank() -> None:
    """This process belongs to a job of more than one rank (a failure must not wait for peers)."""
    global _multi_rank
    _multi_rank = True


def classify(exc: BaseException | None) -> str:
    """``"consequence"`` when the error (or one it was raised from) only says a peer left."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, HorovodShutdownError) or type(exc) is HorovodInternalError:
            return "consequence"
        exc = exc.__cause__ or exc.__context__
    return "cause"


def record_failure(code: int, kind: str, error: str) -> None:
    """Remember the first failure and write the launcher's exit record at once."""
    global _failure
    if _failure is not None or code == 0:
        return
    _failure = Failure(code, kind, error, time.time())
    path = os.environ.get(EXIT_RECORD_ENV)
    if path:
        with contextlib.suppress(OSError):
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(asdict(_failure), fh)


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1  # a message: Python prints it and exits with 1


def _summary(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()[-500:]


class _ExitRequest(SystemExit):
    """``sys.exit()`` after ``hvd.init()``: tells whether it ended the process or was caught.

    When it reaches the top level, Python clears it with no Python frame running; its finalizer
    then sees no caller. Caught by the program, it is released while a frame still runs.
    """

    def __del__(self) -> None:
        try:
            sys._getframe(1)
        except ValueError:
            code = _exit_code(self.code)
            if code:
                record_failure(code, "cause", f"sys.exit({self.code!r})")


def _sys_exit(status: Any = None) -> NoReturn:
    raise _ExitRequest(status)


def _excepthook(orig: Callable[..., Any]) -> Callable[..., Any]:
    def hook(etype: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        code = 130 if issubclass(etype, KeyboardInterrupt) else 1
        record_failure(code, classify(value), _summary(value))
        orig(etype, value, tb)
    hook._horovod = True  # type: ignore[attr-defined]
    return hook


def install() -> None:
    """Watch how the process ends (called by ``hvd.init()``; idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    sys.excepthook = _excepthook(sys.excepthook)
    sys.exit = _sys_exit
    quitter = getattr(builtins, "exit", None)
    if quitter is not None and type(quitter).__name__ == "Quitter":
        base: Any = type(quitter)

        class _Quitter(base):  # type: ignore[misc, valid-type]
            def __call__(self, code: Any = None) -> None:
                with contextlib.suppress(Exception):
                    sys.stdin.close()
                raise _ExitRequest(code)

        builtins.exit = _Quitter("exit", "Ctrl-D (i.e. EOF)")
        builtins.quit = _Quitter("quit", "Ctrl-D (i.e. EOF)")


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
        os._exit(fail.code)
    shutdown()
    _finalize_mpi()
