"""The engine's own buffer operations: ``NumpyBuffers``, ``BufferOps`` on flat host NumPy arrays.

The runner (``buffers.run_reduction``, ``run_pipelined``) carries a plan out with these on every
host lane; a device plane brings its own (``horovod/torch/_torch_buffers.py``). Here live the
host path's rounding (``scale_array``: float16 and bfloat16 scaled in float32 math, integers
truncated), the contiguous view of outputs lying end to end (``span_of``), the fusion buffers
(one per dtype and pipeline slot), the memos of repeated entries and batches (held in the runner's
step memo, ``memo.py``), the narrowing of a compression's wider arrays in the fusion buffer
(``pack_narrowed``/``unpack_narrowed``: only host buffers narrow, ``buffers.NarrowingBuffers``)
and the 64-byte aligned results frameworks wrap without copying (``aligned_empty``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from horovod.common.backends import half
from horovod.common.engine.buffers import Item, Reduction, Segment
from horovod.common.engine.memo import StepMemo

__all__ = ["NumpyBuffers", "scale_array", "span_of", "aligned_empty", "SMALL_OUTPUT_BYTES"]


def scale_array(dst: np.ndarray, src: np.ndarray, factor: float, divisor: int = 1) -> None:
    """dst = src * factor / divisor; float16 and bfloat16 in float32 math (as upstream on the CPU),
    integers truncated."""
    if divisor != 1:
        if dst.dtype.char in half.HALF_CHARS and src.dtype == dst.dtype:
            half.scale(dst, src, 1.0, divisor)
        elif dst.dtype.char in half.HALF_CHARS:
            np.divide(src, np.float32(divisor), out=dst, dtype=np.float32, casting="unsafe")
        else:
            np.divide(src, divisor, out=dst, casting="unsafe")
    elif factor == 1.0:
        if dst is not src:
            np.copyto(dst, src, casting="unsafe")
    elif dst.dtype.char in half.HALF_CHARS and src.dtype == dst.dtype:
        half.scale(dst, src, factor)
    elif dst.dtype.char in half.HALF_CHARS:
        np.multiply(src, np.float32(factor), out=dst, dtype=np.float32, casting="unsafe")
    else:
        np.multiply(src, factor, out=dst, casting="unsafe")


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def span_of(items: Sequence[Item], segs: Sequence[Segment], inplace_only: bool) -> np.ndarray | None:
    """``BufferOps.span`` for flat NumPy outputs. Separate tensors fail at the second segment."""
    i, s, e, _ = segs[0]
    first = items[i].o
    if len(segs) == 1:
        if inplace_only and not items[i].inplace:
            return None
        return first[s:e]
    size = first.itemsize
    at = _addr(first) + s * size
    total = 0
    for i, s, e, _ in segs:
        item = items[i]
        if not item.inplace or _addr(item.o) + s * size != at:
            return None
        at += (e - s) * size
        total += e - s
    return np.lib.stride_tricks.as_strided(first[segs[0][1]:], shape=(total,), strides=(size,))


class _Moves(NamedTuple):
    """A remembered entry's views for one set of segments: the inputs' parts to concatenate into
    the fusion buffer, and (output, buffer view) pairs to copy back."""

    segs: tuple[Segment, ...]
    work: np.dtype
    at: int  # the fusion buffer's address (``run_pipelined`` rotates over several)
    parts: list[np.ndarray]
    pairs: list[tuple[np.ndarray, np.ndarray]]


class _Remembered:
    """``NumpyBuffers.items``' memo of one name: the entry's arrays (a tuple: the caller's list may
    change), its items (a tuple of named tuples), their views."""

    __slots__ = ("arrays", "items", "moves")

    def __init__(self, arrays: tuple[np.ndarray, ...], items: tuple[Item, ...]) -> None:
        self.arrays = arrays
        self.items = items
        self.moves: dict[int, _Moves] = {}  # id(segments) -> views (the segments are kept in it)


class _Batch(NamedTuple):
    """``NumpyBuffers.recall``'s memo of one batch: its entries' arrays, its items and starts."""

    batch: Sequence[Any]
    arrays: tuple[np.ndarray, ...]
    items: tuple[Item, ...]
    starts: list[int]


class NumpyBuffers:
    """``BufferOps`` on flat host NumPy arrays (the engine's own executor)."""

    defer_scale = False

    def __init__(self, empty: Callable[[int], np.ndarray],
                 output: Callable[[tuple[int, ...], Any], np.ndarray] = np.empty,
                 memo: StepMemo | None = None) -> None:
        self._empty = empty  # bytes -> uint8 array (huge-page aligned)
        self._output = output  # (shape, dtype) -> a result array (warm, from the output pool)
        self._buffers: dict[tuple[np.dtype, int], np.ndarray] = {}
        memo = StepMemo() if memo is None else memo  # the runner's step memo (``memo.py``)
        # name -> the last many-tensor entry of that name, its items and their views (``items``)
        self._items: dict[str, _Remembered] = memo.items
        # id(batch) -> its last arrays' ids, then (seen again) the batch's memo (``recall``)
        self._batches: dict[int, _Batch | list[int]] = memo.batches

    #: in-place entries of at least this many tensors have their items remembered; at most this
    #: many names
    ITEMS_MEMO_MIN = 8
    ITEMS_MEMO_SIZE = StepMemo.ITEMS
    #: remembered views per name (one per set of segments a plan cuts the entry into)
    MOVES_MEMO_SIZE = 8

    def result(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A new result of an allgather or reduce-scatter: warm, from the output pool
        (``BufferOps.result``)."""
        return self._output(shape, dtype)

    def outputs(self, inputs: Sequence[np.ndarray], given: Sequence[np.ndarray] | None) -> list[np.ndarray]:
        if given is not None:
            return given if type(given) is list else list(given)
        return [self._output(x.shape, x.dtype) for x in inputs]

    @staticmethod
    def item(new: Any, name: str, x: np.ndarray) -> Item:
        """The item of one array reduced in place (``items`` of ``[x], [x]``): ``batch_items``'
        per-tensor fast path; ``new`` is ``tuple.__new__``."""
        xf = x if x.ndim == 1 else x.reshape(-1)
        return new(Item, (xf, xf, True, name, xf.size))

    def items(self, name: str, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> Sequence[Item]:
        memo = self._items.get(name)
        if (memo is not None and outputs is inputs and len(inputs) == len(memo.arrays)
                and all(map(operator.is_, inputs, memo.arrays))):
            # The same arrays, in place, as this name's last time (a binding resubmitting a
            # repeated grouped operation hands over the same views each step): the same items.
            # The memo holds the arrays, so their identity cannot be reused by others, and an
            # array's memory never moves; the items are a tuple nobody can change.
            return memo.items
        new = tuple.__new__  # an Item without NamedTuple's keyword handling (per tensor)
        out = []
        for x, o in zip(inputs, outputs):
            xf = x if x.ndim == 1 else x.reshape(-1)
            if o is x:
                out.append(new(Item, (xf, xf, True, name, xf.size)))
            else:
                out.append(new(Item, (xf, o if o.ndim == 1 else o.reshape(-1), False, name, xf.size)))
        if outputs is inputs and len(out) >= self.ITEMS_MEMO_MIN:
            # In place only: an out-of-place entry's outputs are new every time (a memo could
            # never hit, and would keep the last outputs alive).
            if len(self._items) >= self.ITEMS_MEMO_SIZE:
                self._items.clear()
            items = tuple(out)
            self._items[name] = _Remembered(tuple(inputs), items)
            return items
        return out

    #: batches of at least this many entries are remembered (``recall``); at most this many
    BATCH_MEMO_MIN = 8
    BATCH_MEMO_SIZE = StepMemo.BATCHES

    def recall(self, batch: Sequence[Any], entries: Sequence[Any]) -> tuple[tuple[Item, ...], list[int]] | None:
        """The items and starts of ``batch`` when it is a remembered one (a memoized plan's, the
        same tuple every step) and every entry hands over, in place, the same one array as then (a
        binding's kept views of the same tensors: ``allreduce_async_`` per gradient, every step);
        None otherwise. The items are a tuple, which ``items``' memo holds too, so that the
        fusion buffer's views of them (``_moves``) are made once."""
        memo = self._batches.get(id(batch))
        if type(memo) is not _Batch or memo.batch is not batch:
            return None
        for e, a in zip(entries, memo.arrays):
            if e is None or e.outputs is not e.inputs or e.inputs[0] is not a:
                return None
        return memo.items, memo.starts

    def remember(self, batch: Sequence[Any], entries: Sequence[Any], items: list[Item],
                 starts: list[int]) -> tuple[Sequence[Item], list[int]]:
        """Note a batch whose entries each hand over one array in place (``batch_items``): the
        first time, only the arrays' identities (holding no array: a binding that hands over new
        arrays every step, as ``tensor.numpy()`` of new gradients, must not have its last step's
        kept alive); when the same arrays come again, the memo ``recall`` answers from (holding
        them: they are the caller's own, kept across steps anyway)."""
        if type(batch) is not tuple or len(batch) < self.BATCH_MEMO_MIN:
            return items, starts
        arrays = [e.inputs[0] for e in entries]
        ids = list(map(id, arrays))
        key = id(batch)
        seen = self._batches.get(key)
        if len(self._batches) >= self.BATCH_MEMO_SIZE:
            self._batches.clear()
        if type(seen) is not list or seen != ids:
            self._batches[key] = ids
            return items, starts
        kept = tuple(items)
        self._batches[key] = _Batch(batch, tuple(arrays), kept, starts)
        if len(self._items) >= self.ITEMS_MEMO_SIZE:
            self._items.clear()
        self._items[kept[0].name] = _Remembered(tuple(arrays), kept)  # for ``_moves``
        return kept, starts

    def _moves(self, buf: np.ndarray, items: Sequence[Item], segs: Sequence[Segment]) -> _Moves | None:
        """The views ``pack``/``unpack`` move between for ``segs`` of a remembered entry's items
        (the one entry of a repeated grouped operation: the same items, the same segments from
        the memoized plans, each step), made once; None for other items, which are moved with
        views made on the way."""
        memo = self._items.get(items[0].name) if items else None
        if memo is None or memo.items is not items or type(segs) is not tuple:
            return None
        moves = memo.moves.get(id(segs))
        at = _addr(buf)
        if moves is not None and moves.segs is segs and moves.work == buf.dtype and moves.at == at:
            return moves
        parts, outs, views = [], [], []
        for i, s, e, b in segs:
            x, o = items[i].x, items[i].o
            whole = s == 0 and e == x.shape[0]
            parts.append(x if whole else x[s:e])
            outs.append(o if whole else o[s:e])
            views.append(buf[b:b + e - s])
        if len(memo.moves) >= self.MOVES_MEMO_SIZE:
            memo.moves.clear()
        moves = memo.moves[id(segs)] = _Moves(segs, buf.dtype, at, parts, list(zip(outs, views)))
        return moves

    def piece(self, a: np.ndarray, start: int, stop: int) -> np.ndarray:
        return a[start:stop]

    span = staticmethod(span_of)

    def buffer(self, work: np.dtype, n: int) -> np.ndarray:
        return self.slot_buffer(work, n, 0)

    def slot_buffer(self, work: np.dtype, n: int, slot: int) -> np.ndarray:
        key = (work, slot)
        buf = self._buffers.get(key)
        if buf is None or buf.size < n:
            buf = self._empty(max(n, 1024) * work.itemsize).view(work)
            self._buffers[key] = buf
            for memo in self._items.values():  # their buffer views are of the one replaced
                memo.moves.clear()
        return buf[:n]

    def zeros(self, n: int, dtype: str) -> np.ndarray:
        return np.zeros(n, dtype)

    scale = staticmethod(scale_array)

    def pack(self, buf: np.ndarray, items: Sequence[Item], segs: Sequence[Segment], pre: float,
             widen: bool) -> None:
        if len(segs) > 2 and not widen:
            # Many small segments: one concatenation (a C loop) into the buffer, then one scaling
            # of the whole buffer; elementwise the same as scaling each segment on its way in.
            moves = self._moves(buf, items, segs)
            if moves is not None:
                parts = moves.parts
            else:
                parts = []
                for i, s, e, _b in segs:
                    x = items[i].x
                    parts.append(x if s == 0 and e == x.shape[0] else x[s:e])
            np.concatenate(parts, out=buf)
            if pre != 1.0:
                scale_array(buf, buf, pre)
            return
        self.pack_each(buf, items, segs, pre, widen)

    @staticmethod
    def pack_each(buf: np.ndarray, items: Sequence[Item], segs: Sequence[Segment], pre: float,
                  widen: bool) -> None:
        """``pack`` one segment at a time (few segments, widened dtypes; the reference of the
        one-call path)."""
        for i, s, e, b in segs:
            dst, src = buf[b:b + e - s], items[i].x[s:e]
            if widen:  # widened, then scaled in the wide type (as upstream on the CPU)
                np.copyto(dst, src, casting="unsafe")
                if pre != 1.0:
                    np.multiply(dst, pre, out=dst)
            else:
                scale_array(dst, src, pre)

    def unpack(self, buf: np.ndarray, items: Sequence[Item], segs: Sequence[Segment], post: float,
               div: int) -> None:
        if len(segs) > 2 and buf.dtype == items[segs[0][0]].o.dtype:
            # Many small segments: scale the whole buffer in place once (elementwise the same as
            # scaling each segment on its way out), then one plain copy per segment.
            if post != 1.0 or div != 1:
                scale_array(buf, buf, post, div)
            moves = self._moves(buf, items, segs)
            if moves is not None:
                for o, v in moves.pairs:
                    o[...] = v
                return
            for i, s, e, b in segs:
                o = items[i].o
                if s == 0 and e == o.shape[0]:
                    o[...] = buf[b:b + e]
                else:
                    o[s:e] = buf[b:b + e - s]
            return
        self.unpack_each(buf, items, segs, post, div)

    @staticmethod
    def unpack_each(buf: np.ndarray, items: Sequence[Item], segs: Sequence[Segment], post: float,
                    div: int) -> None:
        """``unpack`` one segment at a time (the reference of the one-call path)."""
        for i, s, e, b in segs:
            scale_array(items[i].o[s:e], buf[b:b + e - s], post, div)

    def pack_narrowed(self, buf: np.ndarray, items: Sequence[Item], segs: Sequence[Segment], red: Reduction) -> None:
        """``pack`` of a call holding narrowed items (``Reduction.narrow``; NumPy buffers): each wider
        input rounded to the 16-bit dtype straight into the buffer (one pass, the piece then hot for
        the transport), then prescaled in the 16-bit type: the values of ``tensor.to(wire)`` reduced
        as a 16-bit tensor. Where the transport widens the 16-bit dtype (``red.widen``), each piece
        is rounded through a 16-bit scratch first, as that tensor would be. The batch's own 16-bit
        items are packed as ``pack`` does."""
        wire = red.narrow
        for i, s, e, b in segs:
            src, dst = items[i].x[s:e], buf[b:b + e - s]
            if src.dtype == wire:
                self.pack_each(buf, items, ((i, s, e, b),), red.pre, red.widen)
                continue
            if red.widen:
                mid = np.empty(e - s, wire)
                half.cast(mid, src)
                np.copyto(dst, mid, casting="unsafe")
                if red.pre != 1.0:
                    np.multiply(dst, red.pre, out=dst)
            else:
                half.cast(dst, src, red.pre)  # rounded, then prescaled in the 16-bit type, piecewise


    def unpack_narrowed(self, buf: np.ndarray, items: Sequence[Item], segs: Sequence[Segment], red: Reduction) -> None:
        """``unpack`` of a call holding narrowed items: the reduced buffer scaled in the 16-bit type
        (the 16-bit result a 16-bit tensor gets), then widened straight into each wider output (one
        pass), copied into each 16-bit one. Where the transport widens (``red.widen``), each piece is
        scaled and rounded to the 16-bit dtype first, as the 16-bit tensor's result would be."""
        wire = red.narrow
        for i, s, e, b in segs:
            o, v = items[i].o[s:e], buf[b:b + e - s]
            if o.dtype == wire:  # the batch's own 16-bit items
                scale_array(o, v, red.post, red.div)
            elif red.widen:
                mid = np.empty(e - s, wire)
                scale_array(mid, v, red.post, red.div)
                half.cast(o, mid)
            else:
                half.cast(o, v, red.post, red.div)  # scaled in the 16-bit type, widened, piecewise

    def scale_all(self, regions: Sequence[np.ndarray], post: float, div: int) -> None:
        for r in regions:
            scale_array(r, r, post, div)

    @staticmethod
    def dtype(name: str) -> np.dtype:
        return np.dtype(name)

    @staticmethod
    def tensors(inputs: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
        return inputs

    @staticmethod
    def empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return aligned_empty(shape, dtype)

    @staticmethod
    def flat(a: np.ndarray) -> np.ndarray:
        return a.reshape(-1)

    @staticmethod
    def move(a: np.ndarray) -> tuple[np.ndarray, int]:
        return a.reshape(-1).view(_MOVE_DTYPES[a.dtype.itemsize]), 1

    @staticmethod
    def bytes(a: np.ndarray) -> np.ndarray:
        return a.reshape(-1).view(np.uint8)

    def broadcast_outputs(self, inputs: Sequence[np.ndarray], given: Sequence[np.ndarray] | None,
                          is_root: bool) -> list[np.ndarray]:
        if given is None:  # the root's result is its input (nothing moves there)
            return [x if is_root else self._output(x.shape, x.dtype) for x in inputs]
        outs = given if type(given) is list else list(given)
        if is_root:
            for x, o in zip(inputs, outs):
                if o is not x and not np.shares_memory(o, x):
                    np.copyto(o, x)
        return outs


_MOVE_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_ALIGN = 64
# Outputs below this size are not aligned (copying them costs less than aligning them).
SMALL_OUTPUT_BYTES = 4096


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary.

    Frameworks wrap aligned NumPy memory without copying (TensorFlow copies unaligned arrays
    returned from ``numpy_function``); ``np.empty`` only guarantees 16 bytes.
    """
    dtype = np.dtype(dtype)
    n = 1
    for d in shape:
        n *= d
    if n * dtype.itemsize < SMALL_OUTPUT_BYTES:
        return np.empty(shape, dtype)
    raw = np.empty(n * dtype.itemsize + _ALIGN, np.uint8)
    off = (-raw.__array_interface__["data"][0]) % _ALIGN
    return raw[off:off + n * dtype.itemsize].view(dtype).reshape(shape)
