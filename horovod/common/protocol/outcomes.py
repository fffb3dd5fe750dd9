"""What a worker's function ended with, as a launcher reads it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Returned", "Raised", "Exited", "Died", "TaskOutcome", "WorkerOutcome", "task_outcome"]

# What a worker's function ended with, as the worker reports it (pickled: the value and the
# exception go as they are). ``horovod.runner.run_task`` stores Returned or Raised under
# RESULT_SCOPE; a Ray worker (``BaseHorovodWorker.execute_reported``) returns one of the three
# through Ray's object store. Died is the launcher's own record of a worker that never reported.
@dataclass(frozen=True)
class Returned:
    """A worker's function returned ``value``."""

    value: Any


@dataclass(frozen=True)
class Raised:
    """A worker's function raised ``error`` (``traceback``: its text, as the worker printed it)."""

    error: BaseException
    traceback: str = ""


@dataclass(frozen=True)
class Exited:
    """A worker's function called ``sys.exit(code)`` (an elastic worker the job went on without
    exits 0); a non-integer exit code counts as 1."""

    code: int = 0


@dataclass(frozen=True)
class Died:
    """The launcher's record of a worker whose process was lost before it reported (killed, out
    of memory, its node or executor gone): ``error`` is how the launcher saw it."""

    error: BaseException


TaskOutcome = Returned | Raised | Exited
WorkerOutcome = Returned | Raised | Exited | Died


def task_outcome(item: object, who: str = "a worker") -> TaskOutcome:
    """``item`` if it is what a worker reports (:data:`TaskOutcome`), for the launcher reading it.

    Raises:
        HorovodInternalError: anything else (a worker of another horovod-py version).
    """
    if isinstance(item, Returned | Raised | Exited):
        return item
    from horovod.common.exceptions import HorovodInternalError  # the launcher reads; the shim never

    raise HorovodInternalError(f"{who} reported {type(item).__name__} {item!r:.200}, not an outcome "
                               "(Returned, Raised or Exited): the launcher and this worker run "
                               "different horovod-py versions?")
