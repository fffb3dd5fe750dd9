"""Warm memory for out-of-place results: buffers the caller has dropped are handed out again.

An out-of-place allreduce returns new memory every call. Fresh memory from the allocator is
usually fresh pages from the kernel (large blocks are ``mmap``ed and unmapped on free), and
touching them costs a page fault and zeroing per 4 KiB: for a ResNet-50 gradient set (97.5 MiB)
that is as much time as the reduction itself. ``OutputPool`` keeps the raw buffers it handed out;
once the caller has dropped the result and every view of it, the next result of the same size
reuses the buffer, warm. Allgather and reduce-scatter results come from it too (a sharded model,
``hvd.fully_shard``, gathers and reduce-scatters buffers of the same sizes every step).

How the pool knows: each result is built on its own holder array (``np.frombuffer`` over a
``memoryview`` of the raw buffer). NumPy makes every view of the result, and of its views, keep
that holder alive (a view's ``base`` is the first array that is not itself a view of an array),
and whatever wraps the result without copying (``torch.from_numpy``, a ``memoryview``) holds the
result, so a weak reference to the holder is dead exactly when nothing can reach the memory. That
is the language's weak-reference semantics, not an interpreter's reference counts.

Results are never shared: a buffer any array still views is never handed out again.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

__all__ = ["OutputPool", "ALIGN"]

ALIGN = 64
# Results of at least one huge page start on a huge-page boundary (NumPy madvises the block, see
# ``pages``): every whole 2 MiB piece of the result is then one huge page, where the executor
# reduces it (an unaligned block has 4 KiB pages at both ends).
HUGE = 2 * 1024 * 1024


def _align(nbytes: int) -> int:
    return HUGE if nbytes >= HUGE else ALIGN


def _raw(nbytes: int) -> np.ndarray:
    return np.empty(nbytes + _align(nbytes), np.uint8)


def _view(raw: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, nbytes: int) -> np.ndarray:
    off = (-raw.__array_interface__["data"][0]) % _align(nbytes)
    return raw[off:off + nbytes].view(dtype).reshape(shape)


class OutputPool:
    """Aligned result buffers, recycled once the caller has dropped them.

    Args:
        min_bytes: smaller results are allocated plainly (the allocator keeps those warm itself).
        max_bytes: the most bytes the pool tracks; results beyond it are allocated plainly.
    """

    def __init__(self, min_bytes: int = 64 * 1024, max_bytes: int = 1 << 30) -> None:
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self.tracked_bytes = 0
        # size -> [raw buffer, weak reference to the holder of the result last built on it]
        self._by_size: dict[int, list[list[Any]]] = {}

    def _take(self, nbytes: int) -> list[Any] | None:
        slots = self._by_size.get(nbytes)
        if slots is not None:
            for slot in slots:
                ref = slot[1]
                if ref is None or ref() is None:
                    return slot
        if self.tracked_bytes + nbytes > self.max_bytes:
            self._evict_dropped()
            if self.tracked_bytes + nbytes > self.max_bytes:
                return None
        slot = [_raw(nbytes), None]
        self._by_size.setdefault(nbytes, []).append(slot)
        self.tracked_bytes += nbytes
        return slot

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised array whose data starts on a 64-byte boundary (see ``host_buffers.aligned_empty``)."""
        dtype = np.dtype(dtype)
        n = 1
        for d in shape:
            n *= d
        nbytes = n * dtype.itemsize
        if nbytes < self.min_bytes:
            return np.empty(shape, dtype) if nbytes < 4096 else _view(_raw(nbytes), shape, dtype, nbytes)
        slot = self._take(nbytes)
        if slot is None:
            return _view(_raw(nbytes), shape, dtype, nbytes)
        raw = slot[0]
        off = (-raw.__array_interface__["data"][0]) % _align(nbytes)
        holder = np.frombuffer(memoryview(raw[off:off + nbytes]), dtype)
        slot[1] = weakref.ref(holder)
        return holder.reshape(shape)

    def _evict_dropped(self) -> None:
        """Forget the buffers no result uses now (of every size): results whose sizes change from
        call to call (an allgather of batches of varying rows) would otherwise keep the pool full
        of sizes that never come again."""
        for nbytes, slots in list(self._by_size.items()):
            kept = [slot for slot in slots if slot[1] is not None and slot[1]() is not None]
            self.tracked_bytes -= nbytes * (len(slots) - len(kept))
            if kept:
                self._by_size[nbytes] = kept
            else:
                del self._by_size[nbytes]

    def clear(self) -> None:
        self._by_size.clear()
        self.tracked_bytes = 0
