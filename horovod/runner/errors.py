"""The launcher's exception classes, loaded on first use.

They are ``horovod.common.exceptions`` classes (plus ``LaunchError``), but importing
``horovod.common`` loads the whole engine and NumPy (0.3 s and more on a busy 2-core machine),
which ``horovodrun`` must not pay on every start when nothing goes wrong. Runner modules therefore
write ``errors.ConfigError(...)``: the attribute is resolved, and ``horovod.common`` imported, only
when an error is actually raised or caught.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["ConfigError", "BackendUnavailableError", "HorovodError", "LaunchError",
           "WorkerFailedError"]

if TYPE_CHECKING:
    from horovod.common.exceptions import (
        BackendUnavailableError,
        ConfigError,
        HorovodError,
        WorkerFailedError,
    )

    class LaunchError(HorovodError, RuntimeError):
        """A check before launch failed (unreachable host, missing program, missing PyTorch)."""


def __getattr__(name: str) -> Any:
    import horovod.common.exceptions as exceptions

    if name in ("ConfigError", "BackendUnavailableError", "HorovodError", "WorkerFailedError"):
        value = getattr(exceptions, name)
    elif name == "LaunchError":
        class LaunchError(exceptions.HorovodError, RuntimeError):
            """A check before launch failed (unreachable host, missing program, missing PyTorch)."""

        # Made once, on first use; named as a module attribute so that it pickles.
        LaunchError.__module__, LaunchError.__qualname__ = __name__, "LaunchError"
        value = LaunchError
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # resolved once; later lookups are plain attribute reads
    return value
