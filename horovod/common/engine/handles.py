"""Handles: what a caller holds while its operation runs on the engine thread."""

from __future__ import annotations

import _thread
import itertools
from collections.abc import Callable
from typing import Any

from horovod.common import lifecycle as _lifecycle
from horovod.common.exceptions import HorovodInternalError

__all__ = ["Handle", "HandleCounter", "GroupHandle"]


class HandleCounter:
    """Per-process counters: integer handles, and the numbers of unnamed operations.

    An unnamed operation is called ``<op>.noname.<n>``, where ``n`` counts the unnamed calls on
    its process set only. Every member of a set makes the same unnamed calls on it, so every
    member numbers them alike, whatever else each rank does (named operations, operations of
    other sets, or calls that raised: a call that fails its checks still takes its number).
    ``join`` is the exception: a joined rank skips the unnamed calls the others make until every
    rank has joined, so a completed join restarts the numbering of the global set on every rank.
    """

    def __init__(self) -> None:
        self._it = itertools.count()
        self._unnamed: dict[int, itertools.count[int]] = {}
        #: the next integer handle (the counter's own ``__next__``: no Python frame per operation)
        self.next: Callable[[], int] = self._it.__next__

    def unnamed(self, process_set_id: int) -> int:
        """The number of the next unnamed operation on ``process_set_id``."""
        it = self._unnamed.get(process_set_id)
        if it is None:
            it = self._unnamed.setdefault(process_set_id, itertools.count())
        return next(it)

    def restart_unnamed(self, process_set_id: int) -> None:
        """Number the next unnamed operation on ``process_set_id`` 0 again (after a join)."""
        self._unnamed.pop(process_set_id, None)


# Guards the making of a handle's latch (``Handle._latch_of``): rare, only a waiter that must block.
_MAKING = _thread.allocate_lock()


class Handle:
    """Completion of one submitted operation: a latch plus its result or error.

    ``result`` is a list of output arrays (one per tensor of the request); for alltoall each item is
    ``(output, received_splits)``; for join it is the last rank to join. The latch is a bare lock
    (``threading.Event`` costs several times more per operation, and the engine makes one handle per
    tensor), made only when a waiter must block: most handles of a step are complete by the time
    their caller waits (the first wait drives the round that completes them all), and never need
    one. Completion sets ``_done`` before it reads the latch, and a waiter publishes its latch
    before it reads ``_done`` again, so a waiter either sees the operation done or is released.
    """

    __slots__ = ("id", "name", "_latch", "_done", "result", "error", "helper", "request")

    def __init__(self, handle_id: int, name: str) -> None:
        self.id = handle_id
        self.name = name
        self._latch: Any = None  # made by the first waiter that must block (``_latch_of``)
        self._done = False
        self.result: Any = None
        self.error: BaseException | None = None
        # Set by the engine: called by wait() to make progress from the waiting thread.
        self.helper: Any = None
        self.request: Any = None  # the submitted request (a binding prepares it again: ``Context.prepare``)

    def _release(self) -> None:
        """Completion: ``_done`` is set; let blocked waiters through."""
        latch = self._latch
        if latch is not None:
            latch.release()

    def set_result(self, result: Any) -> None:
        self.result = result
        self._done = True
        latch = self._latch  # ``_release``, inlined (once per tensor of a step)
        if latch is not None:
            latch.release()

    def set_error(self, error: BaseException) -> None:
        self.error = error
        self._done = True
        self._release()

    def done(self) -> bool:
        """True once the operation finished (successfully or not); ``wait`` will not block."""
        return self._done

    def _latch_of(self) -> Any:
        """The handle's latch, held until completion: made once, by the first waiter that needs it."""
        latch = self._latch
        if latch is None:
            with _MAKING:
                latch = self._latch
                if latch is None:
                    latch = _thread.allocate_lock()
                    latch.acquire()
                    self._latch = latch
        return latch

    def wait_event(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for completion; True if completed."""
        if self._done:
            return True
        latch = self._latch_of()
        if self._done:  # completed before the latch was published: nobody will release it
            return True
        if latch.acquire(timeout=timeout):
            latch.release()  # let any other waiter through too
            return True
        return self._done

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the operation finishes and return its result.

        Raises:
            HorovodInternalError: the operation failed on the transport or by a mismatch.
            TimeoutError: ``timeout`` seconds passed first.
        """
        if not self._done:
            if self.helper is not None and timeout is None:
                self.helper(self)
            if not self._done and not self.wait_event(-1 if timeout is None else timeout):
                raise TimeoutError(f"operation {self.name!r} did not finish within {timeout} s")
        if self.error is not None:
            kind = getattr(getattr(self.request, "kind", None), "value", None)
            if kind is not None and isinstance(self.error, HorovodInternalError):
                _lifecycle.note_failed_wait(kind, self.name)
            raise self.error
        return self.result


class GroupHandle(Handle):
    """One handle for several entries submitted together (``Engine.submit_many``: a backward
    pass's gradients): it completes when every entry has, with the first error if any failed.

    The engine completes each entry as it would one with its own handle; only the last one
    releases the latch. Entries are completed by the thread driving rounds (one at a time, under
    the engine's driver lock), so the count needs no lock of its own. ``result`` stays None: the
    submitter's outputs are its own in-place buffers.
    """

    __slots__ = ("_left",)

    def __init__(self, handle_id: int, name: str, parts: int) -> None:
        super().__init__(handle_id, name)
        self._left = parts

    def set_result(self, result: Any) -> None:
        """One entry completed (its outputs are the submitter's buffers: ``result`` is dropped)."""
        left = self._left = self._left - 1
        if left == 0:
            self._done = True
            self._release()

    def set_error(self, error: BaseException) -> None:
        """One entry failed: the first error is the handle's; completes like ``set_result``."""
        if self.error is None:
            self.error = error
        self.set_result(None)
