"""``BufferOps`` on torch tensors where they live: the device plane's buffers (CUDA; CPU on the twin).

Scaling follows the host path's rounding (``host_buffers.scale_array``): floats in their own dtype,
integers in float64 and truncated.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from horovod.common.engine.buffers import Item, Segment
from horovod.torch._device_tensor import DeviceTensor, unwrap

__all__ = ["TorchBuffers", "scale_into"]


def scale_into(dst: torch.Tensor, src: torch.Tensor, factor: float, divisor: int = 1) -> None:
    """dst = src * factor / divisor, rounded as the host path does (integers truncated)."""
    if divisor == 1 and factor == 1.0:
        if dst.data_ptr() != src.data_ptr() or dst.dtype != src.dtype:
            dst.copy_(src)
        return
    if not (src.is_floating_point() and dst.dtype == src.dtype):
        wide = src.to(torch.float64)
        wide = wide / divisor if divisor != 1 else wide * factor
        dst.copy_(wide.trunc() if not dst.is_floating_point() else wide)
    elif divisor != 1:
        torch.div(src, divisor, out=dst)
    else:
        torch.mul(src, factor, out=dst)


_SHAPE = operator.attrgetter("shape")
_X = operator.attrgetter("x")
_O = operator.attrgetter("o")


class _Pieces(NamedTuple):
    """A packed call's whole tensors and the fusion buffer's views for them (``_whole``)."""

    segs: Any
    items: Any  # the items tuple they were taken from (None: a list made for one round)
    shapes: list[Any]
    views: list[torch.Tensor]
    xs: list[torch.Tensor]
    os: list[torch.Tensor]
    flat: list[torch.Tensor] | None  # remembered items of the buffer's dtype: 1-D views, packed with one cat


def _flat(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return t if start == 0 and stop == t.numel() else t.reshape(-1)[start:stop]


class TorchBuffers:
    """``BufferOps`` on torch tensors where they live (CUDA memory; CPU on the twin).

    Whole tensors are packed and unpacked with one ``torch._foreach_copy_`` each way (a few fused
    kernels, one Python call for any number of tensors) between them and views of the fusion
    buffer made once per plan (``_pieces``), a fused buffer is scaled once, and tensors reduced in
    place are scaled together at the end of the batch (``defer_scale``).
    """

    defer_scale = True
    #: scale a fused buffer in one pass before unpacking (None: on CUDA, and on the CPU twin for a
    #: buffer too small for torch's thread pool: a pass over a large one wakes the pool, which costs
    #: more than it saves on a busy host, while one operation per tensor costs a microsecond each)
    scale_once: bool | None = None
    #: elements below which a CPU operation runs on the calling thread (ATen's grain size)
    SERIAL_ELEMENTS = 32768
    #: remembered buffer views (one per plan's packed call and buffer)
    PIECES_MEMO_SIZE = 256
    #: remembered items of in-place requests of many tensors, by name (as ``NumpyBuffers``)
    ITEMS_MEMO_MIN = 8
    ITEMS_MEMO_SIZE = 256

    def __init__(self, device: torch.device) -> None:
        self.device = device  # where its fusion buffers, zeros and results live (fixed)
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        # (id(segs), buffer address, dtype) -> _Pieces
        self._pieces: dict[tuple[int, int, torch.dtype], _Pieces] = {}
        # (items, segments, ``_whole``'s answer) of the last ``pack``, for its ``unpack``
        self._packed: tuple[Any, Any, _Pieces | None] | None = None
        # name -> (the wrappers, their items, the outputs: the wrappers' tensors, in place)
        self._items: dict[str, tuple[tuple[Any, ...], tuple[Item, ...], tuple[Any, ...]]] = {}

    def piece(self, a: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return _flat(a, start, stop)

    def span(self, items: Sequence[Item], segs: Sequence[Segment], inplace_only: bool) -> torch.Tensor | None:
        i, st, e, _ = segs[0]
        item = items[i]
        if len(segs) == 1:
            if inplace_only and not item.inplace:
                return None
            return _flat(item.o, st, e)
        first = item.o
        size = first.element_size()
        at = first.data_ptr() + st * size
        # One span only over views of one storage (a flat gradient buffer). Tensors that merely lie
        # end to end in memory have storages of their own (CUDA's caching allocator places small
        # ones side by side), and a view past the first one's storage is out of bounds.
        storage = first.untyped_storage().data_ptr()
        total = 0
        for i, st, e, _ in segs:
            item = items[i]
            o = item.o
            if not item.inplace or o.data_ptr() + st * size != at or o.untyped_storage().data_ptr() != storage:
                return None
            at += (e - st) * size
            total += e - st
        return first.as_strided((total,), (1,), first.storage_offset() + segs[0][1])

    def outputs(self, inputs: Sequence[Any], given: Sequence[Any] | None) -> list[torch.Tensor]:
        if given is not None:
            return [o.tensor if type(o) is DeviceTensor else o for o in given]
        return [torch.empty_like(unwrap(x)) for x in inputs]

    @staticmethod
    def item(new: Any, name: str, x: Any) -> Item:
        """The item of one tensor reduced in place (``items`` of ``[x], [x]``): ``batch_items``'
        per-tensor fast path (a resubmitted ``allreduce_async_``); ``new`` is ``tuple.__new__``."""
        t = x.tensor if type(x) is DeviceTensor else x  # ``unwrap``, inlined (once per tensor)
        return new(Item, (t, t, True, name, t.numel()))

    @staticmethod
    def recall(batch: Sequence[Any], entries: Sequence[Any]) -> tuple[Sequence[Item], list[int]] | None:
        """No batch memo (``BufferOps.recall``): the device plane's batches are built each round."""
        return None

    @staticmethod
    def remember(batch: Sequence[Any], entries: Sequence[Any], items: list[Item],
                 starts: list[int]) -> tuple[Sequence[Item], list[int]]:
        """No batch memo (``BufferOps.remember``): the items as given."""
        return items, starts

    def items(self, name: str, inputs: Sequence[Any], outputs: Sequence[Any]) -> Sequence[Item]:
        memo = self._items.get(name)
        if (memo is not None and len(inputs) == len(memo[0]) and all(map(operator.is_, inputs, memo[0]))
                and all(map(operator.is_, outputs, memo[2]))):
            # The same wrappers and outputs as this name's last time (the CPU twin's repeated
            # grouped call hands over the same ones each step): the same items (a tuple).
            return memo[1]
        new = tuple.__new__  # an Item without NamedTuple's keyword handling (per tensor)
        out = []
        for x, o in zip(inputs, outputs):
            t = unwrap(x)
            o = unwrap(o)
            out.append(new(Item, (t, o, o is t, name, t.numel())))
        if (len(out) >= self.ITEMS_MEMO_MIN and self.device.type != "cuda"
                and all(map(operator.is_, map(_X, out), outputs))):
            # Remembered on the CPU only: CUDA wrappers are new for every call (each carries the
            # call's ready event), so a memo of them could never hit.
            if len(self._items) >= self.ITEMS_MEMO_SIZE:
                self._items.clear()
            items = tuple(out)
            self._items[name] = (tuple(inputs), items, tuple(outputs))
            return items
        return out

    def buffer(self, work: torch.dtype, n: int) -> torch.Tensor:
        buf = self._buffers.get(work)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1024), dtype=work, device=self.device)
            self._buffers[work] = buf
            self._pieces.clear()  # views of the buffer replaced (they would keep it alive)
        return buf[:n]

    def zeros(self, n: int, dtype: str) -> torch.Tensor:
        return torch.zeros(n, dtype=getattr(torch, dtype), device=self.device)

    scale = staticmethod(lambda dst, src, factor, divisor=1: scale_into(dst, src, factor, divisor))

    def pack(self, buf: torch.Tensor, items: Sequence[Item], segs: Sequence[Segment], pre: float,
             widen: bool) -> None:
        whole = self._whole(buf, items, segs)
        # ``unpack`` of the same call (after the reduction) takes the same answer: a round's list
        # of items is not remembered across calls, so it would be worked out twice.
        self._packed = (items, segs, whole)
        if whole is not None:
            if whole.flat is not None:
                torch.cat(whole.flat, out=buf)  # one copy kernel (a foreach copy makes several)
            else:
                torch._foreach_copy_(whole.views, whole.xs)
        else:
            for i, st, e, b in segs:
                buf[b:b + e - st].copy_(_flat(items[i].x, st, e))
        if pre != 1.0:
            scale_into(buf, buf, pre)

    def unpack(self, buf: torch.Tensor, items: Sequence[Item], segs: Sequence[Segment], post: float,
               div: int) -> None:
        scaled = post != 1.0 or div != 1
        if scaled and self._scale_once(buf):
            scale_into(buf, buf, post, div)  # one kernel for the whole buffer
            scaled = False
        packed, self._packed = self._packed, None  # not kept past the call (it holds tensors)
        if packed is not None and packed[0] is items and packed[1] is segs:
            whole = packed[2]
        else:
            whole = self._whole(buf, items, segs)
        if whole is not None:
            dsts, pieces = whole.os, whole.views
            if not scaled:
                torch._foreach_copy_(dsts, pieces)
                return
            work = buf.dtype
            if all(o.dtype == work for o in dsts):
                # Copied exactly, then scaled in place as scale_into would scale the piece: the
                # same rounding, in one call for all tensors instead of one per tensor.
                torch._foreach_copy_(dsts, pieces)
                self.scale_all(dsts, post, div)
                return
            for o, piece in zip(dsts, pieces):
                scale_into(o, piece, post, div)
        else:
            for i, st, e, b in segs:
                scale_into(_flat(items[i].o, st, e), buf[b:b + e - st], post if scaled else 1.0,
                            div if scaled else 1)

    def _scale_once(self, buf: torch.Tensor) -> bool:
        once = self.scale_once
        if once is None:
            return buf.is_cuda or buf.numel() < self.SERIAL_ELEMENTS
        return once

    def _whole(self, buf: torch.Tensor, items: Sequence[Item], segs: Sequence[Segment]) -> _Pieces | None:
        """When ``segs`` are whole tensors: their inputs, outputs and views of ``buf`` end to end
        with their shapes (``unflatten_dense_tensors``); None otherwise.

        The views are made once per packed call of a plan and reused while the buffer and the
        shapes are the same: a memoized plan hands over the same ``segs`` tuple every step, and
        the views hold the buffer's memory, so its address cannot be taken by another buffer while
        they are remembered. The shapes are compared every call (a plan is memoized on sizes,
        which shapes may split differently). Remembered items (a tuple from ``items``' memo) skip
        the per-tensor work altogether: they are the same tensors as last time."""
        key = (id(segs), buf.data_ptr(), buf.dtype) if type(segs) is tuple else None
        memo = self._pieces.get(key) if key is not None else None
        if memo is not None and memo.segs is segs and memo.items is items:
            return memo
        for i, st, e, _ in segs:
            if st != 0 or e != items[i].n:
                return None
        picked = [items[i] for i, *_ in segs]
        xs, os = list(map(_X, picked)), list(map(_O, picked))
        shapes = list(map(_SHAPE, xs))
        if memo is not None and memo.segs is segs and memo.shapes == shapes:
            views = memo.views
        else:
            views = list(torch._C._nn.unflatten_dense_tensors(buf, xs))
        # Items are remembered only as a tuple (``items``' memo, which holds their tensors anyway):
        # a batch's list of items is made afresh every round, and keeping it would keep the last
        # step's tensors (a gradient set) alive.
        kept = type(items) is tuple
        flat = [x.reshape(-1) for x in xs] if kept and all(x.dtype == buf.dtype for x in xs) else None
        found = _Pieces(segs, items if kept else None, shapes, views, xs, os, flat)
        if key is not None:
            if len(self._pieces) >= self.PIECES_MEMO_SIZE:
                self._pieces.clear()
            self._pieces[key] = found if found.items is not None else found._replace(xs=[], os=[], flat=None)
        return found

    def scale_all(self, regions: Sequence[torch.Tensor], post: float, div: int) -> None:
        if regions[0].is_floating_point():
            if div != 1:
                torch._foreach_div_(list(regions), div)
            else:
                torch._foreach_mul_(list(regions), post)
            return
        for r in regions:  # integers: scaled in float64 and truncated, as the host path
            scale_into(r, r, post, div)

    @staticmethod
    def dtype(name: str) -> torch.dtype:
        return getattr(torch, name)

    @staticmethod
    def tensors(inputs: Sequence[Any]) -> list[torch.Tensor]:
        return [unwrap(x) for x in inputs]

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def result(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new allgather or reduce-scatter result (``BufferOps.result``): allocated, from torch's
        caching allocator."""
        return self.empty(shape, dtype)

    @staticmethod
    def flat(a: torch.Tensor) -> torch.Tensor:
        return a.reshape(-1)

    @staticmethod
    def move(a: torch.Tensor) -> tuple[torch.Tensor, int]:
        return a.reshape(-1).view(torch.uint8), a.element_size()

    @staticmethod
    def bytes(a: torch.Tensor) -> torch.Tensor:
        return a.reshape(-1).view(torch.uint8)

    @staticmethod
    def broadcast_outputs(inputs: Sequence[torch.Tensor], given: Sequence[Any] | None,
                          is_root: bool) -> list[torch.Tensor]:
        if given is None:
            return [x.clone() if is_root else torch.empty_like(x) for x in inputs]
        outs = [unwrap(o) for o in given]
        if is_root:
            for x, o in zip(inputs, outs):
                if o is not x:
                    o.copy_(x)
        return outs

    def clear(self) -> None:
        self._packed = None
        self._buffers.clear()
        self._pieces.clear()
        self._items.clear()
