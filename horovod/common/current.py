"""The process's current Horovod context (the one ``hvd.init()`` made), held apart from its class.

Modules that only look the context up (process sets, the process-level functions) import this
small module instead of ``horovod.common.context``, which imports them: no import cycle.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from horovod.common.exceptions import NotInitializedError

if TYPE_CHECKING:
    from horovod.common.context import Context

__all__ = ["get_context", "peek_context", "set_context"]

_context: Context | None = None
_lock = threading.Lock()  # held by init() and shutdown() while they change the context


def get_context() -> Context:
    """Return the live context.

    Raises:
        NotInitializedError: ``hvd.init()`` has not been called (or ``shutdown()`` was).
    """
    ctx = _context
    if ctx is None:
        raise NotInitializedError()
    return ctx


def peek_context() -> Context | None:
    return _context


def set_context(ctx: Context | None) -> None:
    global _context
    _context = ctx
