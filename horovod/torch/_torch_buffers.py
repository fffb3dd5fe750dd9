"""``BufferOps`` on torch tensors where they live: the device plane's buffers (CUDA; CPU on the twin).

Scaling follows the host path's rounding (``buffers.scale_array``): floats in their own dtype,
integers in float64 and truncated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from horovod.common.engine.buffers import Item, Segment
from horovod.torch._device_tensor import unwrap

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


def _whole(items: Sequence[Item], segs: Sequence[Segment]) -> bool:
    for i, st, e, _ in segs:
        if st != 0 or e != items[i].n:
            return False
    return True


def _flat(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return t if start == 0 and stop == t.numel() else t.reshape(-1)[start:stop]


class TorchBuffers:
    """``BufferOps`` on torch tensors where they live (CUDA memory; CPU on the twin).

    Whole tensors are packed and unpacked with one ``torch._foreach_copy_`` each way (a few fused
    kernels, one Python call for any number of tensors), a fused buffer is scaled once, and
    tensors reduced in place are scaled together at the end of the batch (``defer_scale``).
    """

    defer_scale = True
    #: scale a fused buffer in one pass before unpacking (None: on CUDA; on the CPU twin a pass over
    #: the whole buffer wakes torch's thread pool, which costs more than it saves on a busy host)
    scale_once: bool | None = None

    def __init__(self, device: torch.device) -> None:
        self.device = device  # where its fusion buffers, zeros and results live (fixed)
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

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
            return [unwrap(o) for o in given]
        return [torch.empty_like(unwrap(x)) for x in inputs]

    @staticmethod
    def item(new: Any, name: str, x: Any) -> Item:
        """The item of one tensor reduced in place (``items`` of ``[x], [x]``): ``batch_items``'
        per-tensor fast path (a resubmitted ``allreduce_async_``); ``new`` is ``tuple.__new__``."""
        t = unwrap(x)
        return new(Item, (t, t, True, name, t.numel()))

    def items(self, name: str, inputs: Sequence[Any], outputs: Sequence[Any]) -> list[Item]:
        new = tuple.__new__  # an Item without NamedTuple's keyword handling (per tensor)
        out = []
        for x, o in zip(inputs, outputs):
            t = unwrap(x)
            o = unwrap(o)
            out.append(new(Item, (t, o, o is t, name, t.numel())))
        return out

    def buffer(self, work: torch.dtype, n: int) -> torch.Tensor:
        buf = self._buffers.get(work)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1024), dtype=work, device=self.device)
            self._buffers[work] = buf
        return buf[:n]

    def zeros(self, n: int, dtype: str) -> torch.Tensor:
        return torch.zeros(n, dtype=getattr(torch, dtype), device=self.device)

    scale = staticmethod(lambda dst, src, factor, divisor=1: scale_into(dst, src, factor, divisor))

    def pack(self, buf: torch.Tensor, items: Sequence[Item], segs: Sequence[Segment], pre: float,
             widen: bool) -> None:
        if _whole(items, segs):
            srcs = [items[i].x for i, *_ in segs]
            torch._foreach_copy_(torch._C._nn.unflatten_dense_tensors(buf, srcs), srcs)
        else:
            for i, st, e, b in segs:
                buf[b:b + e - st].copy_(_flat(items[i].x, st, e))
        if pre != 1.0:
            scale_into(buf, buf, pre)

    def unpack(self, buf: torch.Tensor, items: Sequence[Item], segs: Sequence[Segment], post: float,
               div: int) -> None:
        scaled = post != 1.0 or div != 1
        if scaled and (buf.is_cuda if self.scale_once is None else self.scale_once):
            scale_into(buf, buf, post, div)  # one kernel for the whole buffer
            scaled = False
        if _whole(items, segs):
            dsts = [items[i].o for i, *_ in segs]
            pieces = torch._C._nn.unflatten_dense_tensors(buf, dsts)
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
        self._buffers.clear()
