"""Handles: what a caller holds while its operation runs on the engine thread."""

from __future__ import annotations

import itertools
import threading
from typing import Any

__all__ = ["Handle", "HandleCounter"]


class HandleCounter:
    """Per-process counter of operations; its values are the integer handles and auto-name suffixes."""

    def __init__(self) -> None:
        self._it = itertools.count()

    def next(self) -> int:
        return next(self._it)


class Handle:
    """Completion of one submitted operation: an event plus its result or error.

    ``result`` is a list of output arrays (one per tensor of the request); for alltoall each item is
    ``(output, received_splits)``; for join it is the last rank to join.
    """

    __slots__ = ("id", "name", "_event", "result", "error", "helper")

    def __init__(self, handle_id: int, name: str) -> None:
        self.id = handle_id
        self.name = name
        self._event = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        # Set by the engine: called by wait() to make progress from the waiting thread.
        self.helper: Any = None

    def set_result(self, result: Any) -> None:
        self.result = result
        self._event.set()

    def set_error(self, error: BaseException) -> None:
        self.error = error
        self._event.set()

    def done(self) -> bool:
        """True once the operation finished (successfully or not); ``wait`` will not block."""
        return self._event.is_set()

    def wait_event(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the operation finishes and return its result.

        Raises:
            HorovodInternalError: the operation failed on the transport or by a mismatch.
            TimeoutError: ``timeout`` seconds passed first.
        """
        if self.helper is not None and timeout is None and not self._event.is_set():
            self.helper(self)
        if not self._event.wait(timeout):
            raise TimeoutError(f"operation {self.name!r} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.result
