"""Exception classes of Horovod.

Every error that Horovod raises is a ``HorovodError``. Each class also derives from the built-in
exception that upstream Horovod raised in the same situation, so ``except RuntimeError`` and
``except ValueError`` code written for upstream keeps working. Errors keep their details as
attributes (``rank``, ``ranks``, ``tensor_name``, ``op``, ``values``) so that callers and tests can
inspect them without parsing text.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "HorovodError",
    "HorovodInternalError",
    "HorovodShutdownError",
    "HorovodVersionMismatchError",
    "HostsUpdatedInterrupt",
    "NotInitializedError",
    "ConfigError",
    "WorkerFailedError",
    "LaunchError",
    "NOT_INITIALIZED_MESSAGE",
    "SHUT_DOWN_MESSAGE",
]

NOT_INITIALIZED_MESSAGE = "Horovod has not been initialized; use hvd.init()."

SHUT_DOWN_MESSAGE = (
    "Horovod has been shut down. This was caused by an exception on one of the ranks or an attempt "
    "to allreduce, allgather or broadcast a tensor after one of the ranks finished execution. If the "
    "shutdown was caused by an exception, you should see the exception in the log before the first "
    "shutdown message."
)


class HorovodError(Exception):
    """Base class of every error raised by Horovod."""

    def __init__(self, message: str = "", **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        for key, value in fields.items():
            setattr(self, key, value)


class HorovodInternalError(HorovodError, RuntimeError):
    """A collective failed in the transport or the engine; elastic training may recover from it."""


class HorovodShutdownError(HorovodInternalError):
    """An operation was submitted to, or was pending in, an engine that has shut down."""


class CollectiveMismatchError(HorovodInternalError, ValueError):
    """Ranks submitted the same tensor name with different shapes, dtypes, ops or roots.

    Raised on every rank that submitted the tensor. The engine keeps serving later operations.
    Derives from ``RuntimeError`` (as upstream Horovod's mismatch errors did) and ``ValueError``.

    Attributes:
        tensor_name: the name the ranks submitted.
        op: the collective ("allreduce", ...).
        field: what disagreed ("shape", "dtype", ...).
        values: mapping of the disagreeing value (as text) to the list of ranks that sent it.
        process_set_id: the process set the operation ran on.
    """


class NotInitializedError(HorovodError, ValueError):
    """A Horovod function was called before ``hvd.init()`` (upstream raised ``ValueError``)."""

    def __init__(self, message: str = NOT_INITIALIZED_MESSAGE, **fields: Any) -> None:
        super().__init__(message, **fields)


class ConfigError(HorovodError, ValueError):
    """A ``HOROVOD_*`` setting or a launcher option has a value that cannot be used."""


class BackendUnavailableError(HorovodError, RuntimeError):
    """The requested transport (MPI, Gloo, NCCL) cannot be used here; the message says why."""


class HostsUpdatedInterrupt(HorovodError, RuntimeError):
    """The set of hosts of an elastic job changed; raised to reset the workers."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated", skip_sync=skip_sync)
        self.skip_sync = skip_sync


class HorovodVersionMismatchError(HorovodError, ImportError):
    """A framework version differs from the one this installation was checked against."""

    def __init__(self, name: str, version: str, installed_version: str) -> None:
        super().__init__(
            f"Framework {name} installed with version {installed_version} but found version {version}.",
            name=name,
            version=version,
            installed_version=installed_version,
        )


class WorkerFailedError(HorovodError, RuntimeError):
    """One or more workers of a job exited with a non-zero status (raised by the launcher)."""


class LaunchError(HorovodError, RuntimeError):
    """A check before launch failed (unreachable host, missing program, missing PyTorch)."""
