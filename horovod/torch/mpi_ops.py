"""Horovod's collectives on PyTorch tensors: async handles, in-place variants, autograd-aware ops.

Every collective must be called by all ranks of its ``process_set`` with the same name (or, when
unnamed, in the same order: unnamed operations are called ``<op>.noname.<handle>``). A mismatch
(dtype, shape, op, root) raises ``HorovodInternalError`` from ``synchronize`` on every rank and the
engine keeps serving later operations. Functions ending in ``_async`` return an integer handle for
``poll``/``synchronize``; functions ending in ``_`` write the result into their input. The
synchronous out-of-place functions are differentiable (``torch.autograd.Function``).

CPU and CUDA tensors are supported; a result lives on its input's device. CUDA tensors run on the
device plane (NCCL through ``torch.distributed``) or host-staged (``HOROVOD_GPU_OPERATIONS``); see
docs/gpu.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from horovod.common import collectives as _C
from horovod.common.context import get_context
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.common.types import Average, ReduceOp, RequestType, Sum
from horovod.torch import _convert as _cv
from horovod.torch import _repeat
from horovod.torch._repeat import (  # noqa: F401 - the repeat path's API here
    _GroupRepeat,
    _repeat_signature,
    _resubmit,
    _resubmit_many,
)
from horovod.torch.compression import Compression, plain_wire

__all__ = [
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_",
    "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async",
    "poll", "synchronize", "join", "barrier",
]

_RED = _MOVE = _cv.TORCH_DTYPES
# A call whose arguments fail a check here fails on every rank of its process set (the other
# ranks must not wait for it): see horovod.common.collectives.fail_everywhere.
_BAD = _C.ARGUMENT_ERRORS
_fail = _C.fail_everywhere
_ALLREDUCE, _ALLGATHER, _BROADCAST = RequestType.ALLREDUCE, RequestType.ALLGATHER, RequestType.BROADCAST
_ALLTOALL, _REDUCESCATTER = RequestType.ALLTOALL, RequestType.REDUCESCATTER


# ---------------------------------------------------------------------------- handles
_register = _C.register_handle
poll = _C.poll
synchronize = _C.synchronize


def _tensors(tensors: Any, what: str, allowed: frozenset[torch.dtype]) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not hasattr(tensors, "__iter__"):
        raise TypeError(f"horovod.torch.{what}() expects a list of tensors, got {type(tensors).__name__}")
    out = [_cv.check_tensor(t, what, allowed) for t in tensors]
    _cv.same_device(out)
    return out


def _one_tensor(tensor: Any, what: str, kind: RequestType, name: str | None, process_set: ProcessSet,
                inplace: bool = False) -> tuple[torch.Tensor, Any, Any, Callable[[Any], Any]]:
    """A data-moving collective's one input, checked (a bad one fails on every rank), routed and
    moved: ``(tensor, device, array, back)``."""
    try:
        t = _cv.check_tensor(tensor, what, _MOVE)
    except _BAD as exc:
        _fail(kind, name, process_set, exc)
    dev = _cv.route(t, kind)
    arr, back = _cv.to_engine(t, inplace, dev)
    return t, dev, arr, back


# ---------------------------------------------------------------------------- allreduce
def _allreduce_submit(tensors: Any, average: bool | None, op: int | None, name: str | None,
                      prescale_factor: float, postscale_factor: float, process_set: ProcessSet,
                      inplace: bool, grouped: bool, what: str, wake: bool = True, wire: str | None = None
                      ) -> tuple[Any, list[Callable[[Any], Any]]]:
    try:
        ts = _tensors(tensors, what, _RED) if grouped else [_cv.check_tensor(tensors, what, _RED)]
        rop = _C.resolve_op(average, op)
        dev = _cv.route(ts[0], _ALLREDUCE, rop)
        arrays, backs = [], []
        for t in ts:
            a, b = _cv.to_engine(t, inplace, dev)
            arrays.append(a)
            backs.append(b)
    except _BAD as exc:
        _fail(_ALLREDUCE, name, process_set, exc, grouped)
    # In place on the working arrays: either the tensors' own memory or private copies.
    h = _C.allreduce_async(arrays, name=name, op=rop, prescale_factor=prescale_factor,
                           postscale_factor=postscale_factor, process_set=process_set,
                           inplace=inplace, grouped=grouped, device=dev, wake=wake, wire=wire)
    return h, backs


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set, _wake: bool = True) -> int:
    """Start reducing ``tensor`` over the ranks of ``process_set`` into a new tensor.

    The input is not modified. All ranks of the set must call it (same name, dtype, shape, op and
    factors). Returns a handle for ``poll``/``synchronize``.

    Raises:
        ValueError: unsupported dtype, a name still in flight, unregistered process set or
            non-member rank, both ``op`` and ``average`` given.
        NotImplementedError: a tensor on a device other than CPU/CUDA; ``op=Adasum`` on a
            non-power-of-two world or a non-global process set.
    """
    h, backs = _allreduce_submit(tensor, average, op, name, prescale_factor, postscale_factor,
                                 process_set, False, False, "allreduce_async", _wake)
    return _register(h, lambda r: backs[0](r[0]))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set, _wake: bool = True) -> int:
    """Start reducing ``tensor`` in place; ``synchronize`` returns the same tensor.

    Raises:
        ValueError, NotImplementedError: as ``allreduce_async``.
    """
    key = None
    if name is not None and average is None:
        key = (name, op, prescale_factor, postscale_factor, getattr(process_set, "process_set_id", None))
        handle = _repeat.repeat_again(key, tensor, _wake)
        if handle is not None:
            return handle
    h, backs = _allreduce_submit(tensor, average, op, name, prescale_factor, postscale_factor,
                                 process_set, True, False, "allreduce_async_", _wake)
    if key is not None:
        _repeat.repeat_remember(key, tensor, h.request)
    return _register(h, lambda r: backs[0](r[0]))


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` in place over the set (default Average) and return it. Blocks."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set, _wake=False))


class HorovodAllreduce(torch.autograd.Function):
    """Differentiable allreduce: the gradient is the allreduce of the incoming gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, prescale: float,
                postscale: float, process_set: ProcessSet) -> torch.Tensor:
        ctx.args = (op, prescale, postscale, process_set)
        return synchronize(allreduce_async(tensor, None, name, op, prescale, postscale, process_set,
                                           _wake=False))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, ps = ctx.args
        grad = synchronize(allreduce_async(grad_output.contiguous(), None, None, op, pre, post, ps,
                                           _wake=False))
        return grad, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks of the set (default Average) and return a new tensor.

    Blocks until every rank of ``process_set`` submitted the same name. Differentiable.

    Raises:
        ValueError, NotImplementedError: as ``allreduce_async``.
        HorovodInternalError: ranks disagree on dtype/shape/op, or the transport failed.
    """
    ts, rop = _checked(tensor, "allreduce", _ALLREDUCE, name, process_set, average, op, False)
    wire = fused_wire(compression, ts, rop)
    if wire is not None:
        h, backs = _allreduce_submit(ts[0], None, rop, name, prescale_factor, postscale_factor, process_set,
                                     False, False, "allreduce", False, wire)
        return synchronize(_register(h, lambda r: backs[0](r[0])))  # type: ignore[no-any-return]
    return _compressed(ts, compression, lambda c: (HorovodAllreduce.apply(
        c, name, rop, prescale_factor, postscale_factor, process_set),))[0]


def fused_wire(compression: Any, tensors: Sequence[torch.Tensor], op: int) -> str | None:
    """The engine's 16-bit dtype name when ``tensors`` are reduced with a plain cast compression
    (``Compression.fp16``/``bf16``, detected by ``compression.plain_wire``: a user's subclass that
    overrides a method keeps the generic compress/decompress path) through the engine's fused
    narrowing (``collectives.allreduce_async(wire=)``: float32 narrowed into the fusion buffer and
    widened out of it, no 16-bit copy of the tensor, no second pass each way); else None.

    Host tensors of one wider float dtype that need no gradient, not Adasum: the same values as
    compress, allreduce of the 16-bit tensor, decompress (the same casts, the same reduction)."""
    if compression is Compression.none or op == ReduceOp.ADASUM:
        return None
    wire = plain_wire(compression)
    if wire is None:
        return None
    if not tensors:
        return None
    grad = torch.is_grad_enabled()
    dtype = tensors[0].dtype
    for t in tensors:
        if (t.dtype != dtype or not t.dtype.is_floating_point or t.dtype == wire or t.device.type != "cpu"
                or (grad and t.requires_grad)):
            return None
    if _cv.route(tensors[0], _ALLREDUCE, ReduceOp(op)) != "cpu":
        return None  # a CPU tensor on the device plane's Gloo twin (``HOROVOD_TORCH_CPU_PLANE``)
    return _WIRE_NAMES.get(wire)


_WIRE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _allreduce_wire_async_(tensor: torch.Tensor, wire: str, name: str | None, op: int, pre: float,
                           post: float, process_set: ProcessSet, _wake: bool = True) -> int:
    """``allreduce_async_`` of ``tensor`` reduced as the 16-bit ``wire`` (``fused_wire``): narrowed
    into the fusion buffer, widened back into ``tensor``. A repeat (same name and arguments, a
    tensor of the same dtype and shape) resubmits the checked request as ``allreduce_async_``
    does."""
    key = ("wire", wire, name, op, pre, post, getattr(process_set, "process_set_id", None))
    if name is not None:
        handle = _repeat.repeat_again(key, tensor, _wake)
        if handle is not None:
            return handle
    h, backs = _allreduce_submit(tensor, None, op, name, pre, post, process_set, True, False,
                                 "allreduce_async_", _wake, wire)
    if name is not None:
        _repeat.repeat_remember(key, tensor, h.request)
    return _register(h, lambda r: backs[0](r[0]))


def _grouped_allreduce_wire_async_(tensors: Sequence[torch.Tensor], wire: str, name: str | None, op: int,
                                   pre: float, post: float, process_set: ProcessSet) -> int:
    """``grouped_allreduce_async_`` of ``tensors`` reduced as the 16-bit ``wire`` (``fused_wire``):
    narrowed into the fusion buffer, widened back into each tensor."""
    h, backs = _allreduce_submit(tensors, None, op, name, pre, post, process_set, True, True,
                                 "grouped_allreduce_async_", True, wire)
    return _register(h, lambda r: tuple(b(x) for b, x in zip(backs, r)))


# ---------------------------------------------------------------------------- grouped allreduce
def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: int | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set, _wake: bool = True) -> int:
    """Start an allreduce of a list of tensors, negotiated and fused as one unit (new outputs)."""
    h, backs = _allreduce_submit(tensors, average, op, name, prescale_factor, postscale_factor,
                                 process_set, False, True, "grouped_allreduce_async", _wake)
    return _register(h, lambda r: tuple(b(x) for b, x in zip(backs, r)))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: int | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set, _wake: bool = True) -> int:
    """Start an in-place grouped allreduce; ``synchronize`` returns the same tensors.

    Repeated with the same name and arguments on tensors of the same dtypes and shapes (a gradient
    set reduced every step), the checked request is resubmitted as ``allreduce_async_`` does."""
    if not isinstance(tensors, list | tuple):
        tensors = list(tensors)  # an iterator is read once: below, the tensors are walked twice
    key = None
    if name is not None and average is None:
        key = ("grouped", name, op, prescale_factor, postscale_factor,
               getattr(process_set, "process_set_id", None))
        handle = _repeat.repeat_again(key, tensors, _wake)
        if handle is not None:
            return handle
    h, backs = _allreduce_submit(tensors, average, op, name, prescale_factor, postscale_factor,
                                 process_set, True, True, "grouped_allreduce_async_", _wake)
    if key is not None:
        _repeat.repeat_remember(key, tensors, h.request, grouped=True)
    return _register(h, lambda r: tuple(b(x) for b, x in zip(backs, r)))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: int | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce every tensor of the list in place (per list position) and return them. Blocks."""
    return list(synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                     postscale_factor, process_set, _wake=False)))


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Differentiable grouped allreduce."""

    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, prescale: float, postscale: float,
                process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, prescale, postscale, process_set)
        return synchronize(grouped_allreduce_async(list(tensors), None, name, op, prescale, postscale,
                                                   process_set, _wake=False))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, ps = ctx.args
        out = synchronize(grouped_allreduce_async([g.contiguous() for g in grads], None, None, op, pre,
                                                  post, ps, _wake=False))
        return (None, None, None, None, None) + tuple(out)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = Compression.none, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce every tensor of the list (per list position) as one fused unit; returns new tensors.

    Differentiable. All ranks of the set must pass lists of the same length, dtypes and shapes.
    """
    ts, rop = _checked(tensors, "grouped_allreduce", _ALLREDUCE, name, process_set, average, op)
    wire = fused_wire(compression, ts, rop)
    if wire is not None:
        h, backs = _allreduce_submit(ts, None, rop, name, prescale_factor, postscale_factor, process_set,
                                     False, True, "grouped_allreduce", False, wire)
        return list(synchronize(_register(h, lambda r: tuple(b(x) for b, x in zip(backs, r)))))
    return _compressed(ts, compression, lambda *cs: HorovodGroupedAllreduce.apply(
        name, rop, prescale_factor, postscale_factor, process_set, *cs))


def _checked(tensors: Any, what: str, kind: RequestType, name: str | None, process_set: ProcessSet,
             average: bool | None, op: int | None, grouped: bool = True) -> tuple[list[torch.Tensor], ReduceOp]:
    """A reduction's tensors (a list, or one tensor unless ``grouped``) and op, checked; a bad
    argument fails on every rank of the set."""
    try:
        ts = _tensors(tensors, what, _RED) if grouped else [_cv.check_tensor(tensors, what, _RED)]
        return ts, _C.resolve_op(average, op)
    except _BAD as exc:
        _fail(kind, name, process_set, exc, grouped)


def _compressed(ts: Sequence[torch.Tensor], compression: Any,
                apply: Callable[..., Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """``apply`` on the compressed tensors, each output decompressed with its input's context."""
    pairs = [compression.compress(t) for t in ts]
    outs = apply(*[c for c, _ in pairs])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: int,
                           process_set: ProcessSet = global_process_set) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse COO tensor by allgathering its indices and values.

    Returns a callable that waits and yields the aggregated sparse tensor (values divided by the
    set size for Average).
    """
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    idx_h = allgather_async(t.indices().t().contiguous(), name=f"{name}.indices", process_set=process_set)
    val_h = allgather_async(t.values().contiguous(), name=f"{name}.values", process_set=process_set)
    n = process_set.size() or 1

    def wait() -> torch.Tensor:
        values = synchronize(val_h)
        indices = synchronize(idx_h)
        if int(op) == int(Average):
            values = values / n
        return torch.sparse_coo_tensor(indices.t(), values, t.size())
    return wait


# ---------------------------------------------------------------------------- allgather
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along dimension 0, in rank order of the set.

    First dimensions may differ between ranks; the other dimensions must match.

    Raises:
        ValueError: unsupported dtype, a 0-d tensor, a name still in flight, a process set problem.
    """
    t, dev, arr, _ = _one_tensor(tensor, "allgather_async", _ALLGATHER, name, process_set)
    h = _C.allgather_async([arr], name=name, process_set=process_set, device=dev)
    return _register(h, lambda r: _cv.from_engine(r[0], t, arr))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start allgathering each tensor of the list as one unit."""
    try:
        ts = _tensors(tensors, "grouped_allgather_async", _MOVE)
    except _BAD as exc:
        _fail(_ALLGATHER, name, process_set, exc, True)
    dev = _cv.route(ts[0], _ALLGATHER)
    arrays = [_cv.to_engine(t, False, dev)[0] for t in ts]
    h = _C.allgather_async(arrays, name=name, process_set=process_set, grouped=True, device=dev)
    return _register(h, lambda r: tuple(_cv.from_engine(x, t, a) for x, t, a in zip(r, ts, arrays)))


def _rank_offset(dim0: int, process_set: ProcessSet) -> int:
    dims = synchronize(allgather_async(torch.tensor([dim0], dtype=torch.int64), process_set=process_set))
    r = process_set.rank() or 0
    return int(dims[:r].sum())


class HorovodAllgather(torch.autograd.Function):
    """Differentiable allgather: averaged allreduce of the gradient, then this rank's rows."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet) -> torch.Tensor:
        out = synchronize(allgather_async(tensor, name, process_set))  # rejects 0-d tensors
        ctx.dim = tensor.shape[0]
        ctx.process_set = process_set
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        ps = ctx.process_set
        grad = synchronize(allreduce_async(grad_output.contiguous(), op=Average, process_set=ps))
        return grad.narrow(0, _rank_offset(ctx.dim, ps), ctx.dim), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0 (rank order); blocks. Differentiable."""
    try:
        _cv.check_tensor(tensor, "allgather", _MOVE)
    except _BAD as exc:
        _fail(_ALLGATHER, name, process_set, exc)
    return HorovodAllgather.apply(tensor, name, process_set)


class HorovodGroupedAllgather(torch.autograd.Function):
    """Differentiable grouped allgather."""

    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: ProcessSet,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = synchronize(grouped_allgather_async(list(tensors), name, process_set))
        ctx.dims = [t.shape[0] for t in tensors]
        ctx.process_set = process_set
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ps = ctx.process_set
        reduced = synchronize(grouped_allreduce_async([g.contiguous() for g in grads], op=Average,
                                                      process_set=ps))
        dims = synchronize(allgather_async(torch.tensor([ctx.dims], dtype=torch.int64), process_set=ps))
        r = ps.rank() or 0
        offsets = dims[:r].sum(dim=0).tolist() if r else [0] * len(ctx.dims)
        return (None, None) + tuple(g.narrow(0, int(o), d) for g, o, d in zip(reduced, offsets, ctx.dims))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather each tensor of the list as one unit; returns a list. Differentiable."""
    try:
        ts = _tensors(tensors, "grouped_allgather", _MOVE)
    except _BAD as exc:
        _fail(_ALLGATHER, name, process_set, exc, True)
    return list(HorovodGroupedAllgather.apply(name, process_set, *ts))


# ---------------------------------------------------------------------------- broadcast
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set, _wake: bool = True) -> int:
    """Start copying the root rank's ``tensor`` into a new tensor on every rank of the set.

    ``root_rank`` is a global rank. The input is not modified.

    Raises:
        ValueError: unsupported dtype, root not in the set, a name still in flight.
    """
    t, dev, arr, back = _one_tensor(tensor, "broadcast_async", _BROADCAST, name, process_set)
    h = _C.broadcast_async([arr], root_rank, name=name, process_set=process_set, device=dev, wake=_wake)

    def post(r: list[Any]) -> torch.Tensor:
        # On the root the host path hands back the input buffer itself: copy it out.
        shared = isinstance(r[0], np.ndarray) and np.shares_memory(r[0], arr)
        return back(r[0].copy() if shared else r[0])
    return _register(h, post)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set, _wake: bool = True) -> int:
    """Start overwriting ``tensor`` with the root rank's values; ``synchronize`` returns it."""
    t, dev, arr, back = _one_tensor(tensor, "broadcast_async_", _BROADCAST, name, process_set, inplace=True)
    h = _C.broadcast_async([arr], root_rank, name=name, process_set=process_set, inplace=True, device=dev,
                           wake=_wake)
    return _register(h, lambda r: back(r[0]))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with the root rank's values and return it. Blocks."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set, _wake=False))


class HorovodBroadcast(torch.autograd.Function):
    """Differentiable broadcast: averaged allreduce of the gradient, kept on the root only."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set, _wake=False))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad = synchronize(allreduce_async(grad_output.contiguous(), op=Average,
                                           process_set=ctx.process_set))
        if get_context().topology.rank != ctx.root_rank:
            grad = grad * 0
        return grad, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return the root rank's ``tensor`` on every rank of the set; blocks. Differentiable."""
    try:
        _cv.check_tensor(tensor, "broadcast", _MOVE)
    except _BAD as exc:
        _fail(_BROADCAST, name, process_set, exc)
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


# ---------------------------------------------------------------------------- alltoall
def _splits_array(splits: Any) -> Any:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype.is_complex or splits.dtype == torch.bool:
            raise ValueError(f"alltoall: splits must be a tensor of 32-bit integers (torch.int32) or "
                             f"a list of ints, got a {splits.dtype} tensor.")
        return splits.detach().to("cpu", torch.int64).numpy()
    return splits


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start an alltoall; ``synchronize`` returns ``(output, received_splits)``.

    ``splits[i]`` rows of dimension 0 go to rank i of the set (int32 tensor or list, one entry per
    rank); without ``splits`` dimension 0 is divided evenly.

    Raises:
        ValueError: bad splits, dimension 0 not divisible without splits, unsupported dtype.
    """
    try:
        t = _cv.check_tensor(tensor, "alltoall_async", _MOVE)
        split_arr = _splits_array(splits)
    except _BAD as exc:
        _fail(_ALLTOALL, name, process_set, exc)
    dev = _cv.route(t, _ALLTOALL)
    arr, _ = _cv.to_engine(t, False, dev)
    h = _C.alltoall_async(arr, split_arr, name=name, process_set=process_set, device=dev)

    def post(r: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        out, received = r[0]
        return _cv.from_engine(out, t, arr), torch.from_numpy(np.asarray(received, np.int32))
    return _register(h, post)


class HorovodAlltoall(torch.autograd.Function):
    """Differentiable alltoall: the gradient travels back with the received splits."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                process_set: ProcessSet) -> tuple[torch.Tensor, torch.Tensor]:
        out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received = received
        ctx.rows = tensor.shape[0]
        ctx.process_set = process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, _grad_splits: Any) -> tuple[Any, ...]:
        grad, _ = synchronize(alltoall_async(grad_output.contiguous(), ctx.received,
                                             process_set=ctx.process_set))
        if grad.shape[0] < ctx.rows:  # rows beyond sum(splits) were not sent: zero gradient
            pad = grad.new_zeros((ctx.rows - grad.shape[0],) + tuple(grad.shape[1:]))
            grad = torch.cat([grad, pad])
        return grad, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send slices of dimension 0 to every rank of the set and receive theirs; blocks.

    Returns the output, or ``(output, received_splits)`` when ``splits`` is given. Differentiable.
    """
    try:
        _cv.check_tensor(tensor, "alltoall", _MOVE)
        _splits_array(splits)
    except _BAD as exc:
        _fail(_ALLTOALL, name, process_set, exc)
    out, received = HorovodAlltoall.apply(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


# ---------------------------------------------------------------------------- reducescatter
def _reducescatter_submit(tensors: Any, name: str | None, op: int, process_set: ProcessSet,
                          prescale: float, postscale: float, grouped: bool, what: str) -> Any:
    try:
        ts = _tensors(tensors, what, _RED) if grouped else [_cv.check_tensor(tensors, what, _RED)]
        rop = _C.resolve_op(None, op)
        dev = _cv.route(ts[0], _REDUCESCATTER, rop)
        arrays = [_cv.to_engine(t, False, dev)[0] for t in ts]
    except _BAD as exc:
        _fail(_REDUCESCATTER, name, process_set, exc, grouped)
    return ts, arrays, _C.reducescatter_async(arrays, name=name, op=rop, process_set=process_set,
                                              prescale_factor=prescale, postscale_factor=postscale,
                                              grouped=grouped, device=dev)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start reducing ``tensor`` over the set; this rank receives its rows of dimension 0.

    With N rows and P ranks, ranks 0 .. N%P-1 receive N//P+1 rows and the others N//P.

    Raises:
        ValueError: an op other than Average/Sum, a 0-d tensor, unsupported dtype.
    """
    ts, bufs, h = _reducescatter_submit(tensor, name, op, process_set, prescale_factor, postscale_factor,
                                        False, "reducescatter_async")
    return _register(h, lambda r: _cv.from_engine(r[0], ts[0], bufs[0]))


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: int = Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start a reducescatter of each tensor of the list as one unit."""
    ts, bufs, h = _reducescatter_submit(tensors, name, op, process_set, prescale_factor, postscale_factor,
                                        True, "grouped_reducescatter_async")
    return _register(h, lambda r: tuple(_cv.from_engine(x, t, b) for x, t, b in zip(r, ts, bufs)))


def _reducescatter_grad(grads: Sequence[torch.Tensor], op: ReduceOp, pre: float, post: float,
                        ps: ProcessSet) -> list[torch.Tensor]:
    gathered = synchronize(grouped_allgather_async([g.contiguous() for g in grads], process_set=ps))
    scale = (float(ps.size() or 1) if op == Sum else 1.0) * pre * post
    return [g * scale if scale != 1.0 else g for g in gathered]


class HorovodReducescatter(torch.autograd.Function):
    """Differentiable reducescatter: the gradient is the allgather of the incoming gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: int, process_set: ProcessSet,
                prescale: float, postscale: float) -> torch.Tensor:
        ctx.args = (ReduceOp(int(op)), prescale, postscale, process_set)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale, postscale))

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, ps = ctx.args
        return (_reducescatter_grad([grad_output], op, pre, post, ps)[0],) + (None,) * 5


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = Compression.none,
                  op: int = Average, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over the set and return this rank's rows; blocks. Differentiable."""
    ts, rop = _checked(tensor, "reducescatter", _REDUCESCATTER, name, process_set, None, op, False)
    return _compressed(ts, compression, lambda c: (HorovodReducescatter.apply(
        c, name, rop, process_set, prescale_factor, postscale_factor),))[0]


class HorovodGroupedReducescatter(torch.autograd.Function):
    """Differentiable grouped reducescatter."""

    @staticmethod
    def forward(ctx: Any, name: str | None, op: int, process_set: ProcessSet, prescale: float,
                postscale: float, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (ReduceOp(int(op)), prescale, postscale, process_set)
        return synchronize(grouped_reducescatter_async(list(tensors), name, op, process_set, prescale,
                                                       postscale))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, ps = ctx.args
        return (None,) * 5 + tuple(_reducescatter_grad(grads, op, pre, post, ps))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reducescatter each tensor of the list as one unit; returns a list. Differentiable."""
    ts, rop = _checked(tensors, "grouped_reducescatter", _REDUCESCATTER, name, process_set, None, op)
    return _compressed(ts, compression, lambda *cs: HorovodGroupedReducescatter.apply(
        name, rop, process_set, prescale_factor, postscale_factor, *cs))


# ---------------------------------------------------------------------------- control
def join(device: int = -1) -> int:
    """Declare that this rank has no more data and block until every rank has joined.

    While waiting, this rank contributes zeros to the other ranks' allreduces (Average still
    divides by the full set size). Returns the global rank that joined last, the same on every
    rank. ``device``: the GPU on which zeros for CUDA allreduces are made (default: the GPU this
    process last reduced on); CPU zeros for host tensors.
    """
    _cv.set_join_device(int(device))
    return _C.join()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of ``process_set`` calls ``barrier``."""
    _C.barrier(process_set)
