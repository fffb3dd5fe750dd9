"""Resubmitting a checked request as it is: the fast path of an in-place operation repeated every
step on tensors of the same signature (a gradient hook, a metric averaged by hand, a grouped
gradient set).

The first call of a named in-place allreduce takes the checked path; it leaves a *repeat
signature* (``_repeat_signature``): the request, the context and process set it was checked in,
the tensor's dtype and shape. A later call whose tensor still matches resubmits that request on
the tensor's memory (``_resubmit``; ``_resubmit_many`` for a backward pass's gradients under one
handle; ``_GroupRepeat`` for a grouped call), skipping the checks, conversions and the request's
construction. Anything else takes the checked path again.

Host tensors are handed over as NumPy views; tensors of the torch device plane (CUDA, or CPU
tensors with ``HOROVOD_TORCH_CPU_PLANE=1``) as ``DeviceTensor`` wrappers made without the
checked path's per-tensor work (their shape, dtype name and rank come from the signature). On
CUDA each wrapper still records its ready event on the caller's current stream at submission:
that point of the stream is what the plane's stream must wait for.
"""

from __future__ import annotations

import ctypes
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from horovod.common.context import Prepared, get_context, peek_context
from horovod.common.types import ReduceOp
from horovod.torch import _convert as _cv
from horovod.torch._device_tensor import DeviceTensor, again, again_many, wait_done


class _Same:
    """A handle's post step that returns the tensor reduced in place (and keeps it alive)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __call__(self, _result: Any) -> torch.Tensor:
        return self.tensor


# Named in-place allreduces repeated with the same arguments (a metric averaged every step, a
# gradient reduced by hand): (name, op, factors, process set) -> ``_repeat_signature``, kept in
# the context they were checked in (``Context.repeats``: they go with it). A repeat whose tensor
# still matches resubmits the checked request as it is (``_resubmit``), skipping the checks and
# conversions; anything else takes the checked path. Bounded: cleared when full (names made fresh
# every step would only grow it). The optimizer's gradient hooks keep their own per-parameter
# signatures. ``mpi_ops`` asks ``repeat_again`` (one call per repeated call) and, after the checked
# path, ``repeat_remember``.
_REPEAT_MAX = 4096


def repeat_again(key: tuple[Any, ...], tensors: Any, wake: bool) -> int | None:
    """Resubmit the request remembered under ``key`` on ``tensors`` (one tensor; a list for a
    grouped key, whose first item is "grouped") when they still match it: the handle; else None."""
    ctx = peek_context()
    if ctx is None:
        return None
    repeat = ctx.repeats.get(key)
    if repeat is None:
        return None
    if type(repeat) is not _GroupRepeat:
        return _resubmit(tensors, repeat, wake, live=ctx)
    arrays = repeat.views(ctx, tensors)
    if arrays is None:
        return None
    return repeat.prepared.submit(arrays, arrays, wake=wake, post=repeat.post).id


def repeat_remember(key: tuple[Any, ...], tensors: Any, request: Any, grouped: bool = False) -> None:
    """After the checked path submitted ``request`` on ``tensors`` in place: remember it under
    ``key`` when it may be resubmitted unchecked (``_repeat_signature``)."""
    if grouped:
        if not tensors:
            return
        signatures = tuple(_repeat_signature(t, request) for t in tensors)
        if all(sig is not None for sig in signatures):
            _remember(key, _GroupRepeat(signatures))  # type: ignore[arg-type]  # None ruled out above
        return
    signature = _repeat_signature(tensors, request)
    if signature is not None:
        _remember(key, signature)


class _HostView:
    """A host signature's NumPy view of the tensor it last saw twice (``array``).

    ``tensor.numpy()`` costs about a microsecond, the largest part of a resubmission. A tensor
    object seen again at the same address (a weak reference and the data pointer; dtype, shape
    and contiguity are checked by the caller, so the view is of the tensor's current memory) gets
    a view made once, on its second call, and reused from then on. The view does not reference
    the tensor or its storage: keeping a gradient alive past ``zero_grad(set_to_none=True)``
    would hold a second gradient set. It is handed out only while the caller holds the tensor,
    whose handle keeps it alive until ``synchronize``. A new tensor every step (``set_to_none``)
    costs one weak reference more than ``numpy()`` alone."""

    __slots__ = ("ref", "ptr", "array")
    host = True

    def __init__(self) -> None:
        self.ref: Any = None
        self.ptr = 0
        self.array: np.ndarray | None = None

    def view(self, tensor: torch.Tensor) -> np.ndarray:
        ref = self.ref
        if ref is not None and ref() is tensor and tensor.data_ptr() == self.ptr:
            arr = self.array
            if arr is not None:
                return arr
            arr = tensor.numpy()
            if arr.nbytes:  # the second call with this tensor: make the view that is kept
                raw = (ctypes.c_char * arr.nbytes).from_address(self.ptr)
                # The engine reduces a large tensor where it lies only if its memory is on huge
                # pages, which it learns by walking from the array to the memory's owner: this
                # block, which must say so for its tensor (without it, every large gradient of a
                # repeated step was copied through the fusion buffer: ResNet-50's set at np=2
                # spent 35 ms of a 59-63 ms step packing and unpacking 97 MiB; 49-55 ms with it).
                setattr(raw, _cv.HUGE_PAGES_ATTR, bool(_cv.memory_on_huge_pages(tensor)))
                self.array = arr = np.frombuffer(raw, arr.dtype).reshape(arr.shape)
            return arr
        self.ref, self.ptr, self.array = weakref.ref(tensor), tensor.data_ptr(), None
        return tensor.numpy()


class _PlaneView:
    """A device-plane signature's wrapper facts: what ``DeviceTensor`` reads from each tensor."""

    __slots__ = ("shape", "dtype", "ndim", "cuda")
    host = False

    def __init__(self, w: DeviceTensor, cuda: bool) -> None:
        self.shape, self.dtype, self.ndim, self.cuda = w.shape, w.dtype, w.ndim, cuda


def _repeat_signature(tensor: torch.Tensor, req: Any) -> tuple[Any, ...] | None:
    """What a later resubmission of ``req`` checks its tensor against, or None when ``req`` (just
    submitted with ``tensor``, in place) may not be resubmitted unchecked: only non-Adasum
    reductions of contiguous tensors without autograd, on the host path (dtypes NumPy views
    directly) or on the torch device plane."""
    if (req.reduce_op == ReduceOp.ADASUM or not tensor.is_contiguous() or tensor.requires_grad
            or type(tensor) is not torch.Tensor):
        return None
    memo: Any
    if req.device == "cpu":
        if tensor.dtype not in _cv.DIRECT_DTYPES:
            return None
        memo = _HostView()
    elif req.device in _PLANES:
        memo = _PlaneView(DeviceTensor(tensor), tensor.is_cuda)
    else:
        return None
    ctx = get_context()
    group = ctx.groups.get(req.process_set_id)
    dtype, shape = tensor.dtype, tensor.shape
    # (context, the request prepared in it, dtype, shape, group, the tensor's expected _PROBE,
    # where it was checked, the host view or the plane wrapper's facts)
    return (ctx, ctx.prepare(req), dtype, shape, group, (dtype, shape, False, torch.strided, not tensor.is_cuda),
            (ctx, req.process_set_id, group), memo)


_PLANES = frozenset(d for d in (_cv.PLANE_CPU, _cv.PLANE_CUDA) if d)


# What a resubmitted tensor must still be, read for many tensors at once (C loops): its dtype,
# shape, no autograd, dense, on the host (``_repeat_signature``'s sixth item); and contiguous.
_PROBE = operator.attrgetter("dtype", "shape", "requires_grad", "layout", "is_cpu")
_CONTIGUOUS = operator.methodcaller("is_contiguous")
_DATA_PTR = operator.methodcaller("data_ptr")
_PROBE_OF = operator.itemgetter(5)
_HOME_OF = operator.itemgetter(6)


def _resubmit(tensor: Any, signature: tuple[Any, ...], wake: bool = True, defer: bool = False,
              live: Any = None) -> int | None:
    """Resubmit the request of ``signature`` on ``tensor`` in place when the tensor still matches
    it (dtype, shape, context, process set, a plain dense contiguous tensor on the signature's
    device); None when it does not. ``live``: the live context when the caller has just read it
    (``repeat_again``), so that it is not looked up twice per tensor."""
    # _matches(tensor, signature), inlined: this runs once per gradient per step.
    ctx, prepared, dtype, shape, group, _probe, (_, ps_id, _), memo = signature
    if (type(tensor) is torch.Tensor and tensor.dtype is dtype and tensor.shape == shape
            and ctx.groups.get(ps_id) is group and ctx is (peek_context() if live is None else live)
            and not tensor.requires_grad and tensor.layout is torch.strided and tensor.is_contiguous()):
        if memo.host:
            if tensor.is_cpu:
                # ``memo.view(tensor)``'s answer for the tensor it keeps a view of, inlined
                arr = memo.array
                if arr is None or memo.ref() is not tensor or tensor.data_ptr() != memo.ptr:
                    arr = memo.view(tensor)
                buf = [arr]
                return prepared.submit(buf, buf, None, wake, defer, _Same(tensor)).id
        elif not memo.cuda:
            if tensor.is_cpu:  # the CPU twin: no events, nothing to wait for in synchronize
                w: list[Any] = [again(tensor, memo.shape, memo.dtype, memo.ndim, False)]
                return prepared.submit(w, w, None, wake, defer, _Same(tensor)).id
        elif tensor.is_cuda and tensor.get_device() == torch.cuda.current_device():
            cw: list[Any] = [again(tensor, memo.shape, memo.dtype, memo.ndim, True)]
            return prepared.submit(cw, cw, None, wake, defer, _PlaneSame(cw[0])).id
    return None


class _PlaneSame:
    """A CUDA plane handle's post step: the caller's stream waits for the plane's "done" event
    (as the checked path's ``back`` does), then the tensor reduced in place is returned."""

    __slots__ = ("w",)

    def __init__(self, w: DeviceTensor) -> None:
        self.w = w

    def __call__(self, _result: Any) -> torch.Tensor:
        w = self.w
        wait_done((w,), ())
        return w.tensor


class _Each:
    """A bundle handle's post step: the tensors reduced in place (and keeps them alive)."""

    __slots__ = ("tensors",)

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = tensors

    def __call__(self, _result: Any) -> Sequence[torch.Tensor]:
        return self.tensors


def _resubmit_many(tensors: list[torch.Tensor], signatures: list[tuple[Any, ...]], defer: bool = False,
                   wake: bool = True) -> int | None:
    """``_resubmit`` for many tensors with one handle (``Prepared.submit_all``): a backward
    pass's gradients. None, submitting nothing, unless every tensor still matches its signature
    and all signatures share the live context."""
    ctx = peek_context()
    if ctx is None or not tensors or not _all_match(ctx, tensors, signatures):
        return None
    views = []
    for t, s in zip(tensors, signatures):
        memo = s[7]
        if not memo.host:  # device-plane signatures are resubmitted one by one (``_resubmit``)
            return None
        views.append(memo.view(t))
    return Prepared.submit_all([s[1] for s in signatures], views, _Each(tensors), wake, defer)


def _all_match(ctx: Any, tensors: Sequence[Any], signatures: Sequence[tuple[Any, ...]]) -> bool:
    """Every tensor is a plain dense contiguous CPU tensor of its signature's dtype and shape, and
    every signature was checked in ``ctx`` (the live context) on a still-registered process set.

    Vectorised: the tensors' attributes are read with ``map`` and compared as lists, and each
    distinct (context, process set) of the signatures is checked once (a gradient set's
    signatures share one)."""
    if len(tensors) != len(signatures):
        return False
    groups = ctx.groups
    for sctx, ps_id, group in set(map(_HOME_OF, signatures)):
        if sctx is not ctx or groups.get(ps_id) is not group:
            return False
    return (set(map(type, tensors)) <= _PLAIN
            and list(map(_PROBE, tensors)) == list(map(_PROBE_OF, signatures))
            and all(map(_CONTIGUOUS, tensors)))


_PLAIN = frozenset((torch.Tensor,))


def _remember(key: tuple[Any, ...], signature: Any) -> None:
    """Keep a signature (or a ``_GroupRepeat``) under ``key`` in the context it was checked in."""
    repeats = get_context().repeats
    if len(repeats) >= _REPEAT_MAX:
        repeats.clear()
    repeats[key] = signature


class _GroupRepeat:
    """A named in-place grouped allreduce repeated with the same arguments: its tensors'
    signatures, and the tensors of the last repeat with what was handed to the engine for them.

    ``views`` returns the buffers to resubmit (NumPy views on the host path, ``DeviceTensor``
    wrappers on the device plane), or None when the tensors no longer match (the caller takes
    the checked path). The same tensor objects as last time (a fixed gradient or metric set)
    reuse last time's buffers after a check of what could have changed in place (data pointer,
    dtype, shape, layout, autograd, contiguity), without making new ones; other tensors are
    checked like any resubmission (``_all_match``) and become the remembered ones. The same list
    is handed to the engine each time, so its per-entry work is reused too
    (``NumpyBuffers.items``). On CUDA the wrappers are made again for each call, sharing one
    ready event recorded on the caller's stream (``again_many``): an event marks one point of
    one stream, and a resubmission is a new point. ``post`` is the handle's post step of the
    last call. The last tensors stay referenced until the name's next call (or until
    ``Context.repeats`` is cleared when full): one set per name, as the caller's own."""

    __slots__ = ("signatures", "prepared", "request", "probes", "tensors", "arrays", "ptrs", "post", "facts",
                 "cuda")

    def __init__(self, signatures: tuple[tuple[Any, ...], ...]) -> None:
        self.signatures = signatures
        self.prepared = signatures[0][1]  # the checked request, prepared in its context
        self.request = self.prepared.request
        self.probes = list(map(_PROBE_OF, signatures))
        self.tensors: tuple[torch.Tensor, ...] = ()
        self.arrays: list[Any] = []
        self.ptrs: list[int] = []
        self.post: Callable[[Any], Any] = _Each([])
        memo = signatures[0][7]
        # The plane's per-tensor facts (None on the host path), and whether they are CUDA tensors.
        self.facts: list[Any] | None = None if memo.host else [s[7] for s in signatures]
        self.cuda = not memo.host and memo.cuda

    def views(self, ctx: Any, tensors: Sequence[Any]) -> list[Any] | None:
        last = self.tensors
        if len(tensors) == len(last) and all(map(operator.is_, tensors, last)):
            sctx, ps_id, group = self.signatures[0][6]
            if (sctx is ctx and ctx.groups.get(ps_id) is group
                    and list(map(_DATA_PTR, tensors)) == self.ptrs
                    and list(map(_PROBE, tensors)) == self.probes and all(map(_CONTIGUOUS, tensors))):
                if not self.cuda:
                    return self.arrays
                if torch.cuda.current_device() == tensors[0].get_device():
                    return self._again()
                return None  # the checked path says which tensor is on another GPU
        if not _all_match(ctx, tensors, self.signatures):
            return None
        if self.cuda:  # on this process's GPU, all of them (else the checked path says which is not)
            current = torch.cuda.current_device()
            if any(t.get_device() != current for t in tensors):
                return None
        self.tensors = tuple(tensors)
        self.ptrs = list(map(_DATA_PTR, self.tensors))
        if self.facts is None:
            self.arrays = [t.numpy() for t in self.tensors]
        elif not self.cuda:  # the CPU twin: wrappers without events, reusable as they are
            self.arrays = again_many(self.tensors, self.facts, False)
        else:
            return self._again()
        self.post = _Each(self.tensors)
        return self.arrays

    def _again(self) -> list[Any]:
        wrappers = again_many(self.tensors, self.facts or [], True)
        self.post = _PlaneEach(wrappers, self.tensors)
        return wrappers


class _PlaneEach:
    """A CUDA plane grouped handle's post step: the caller's stream waits for the batch's "done"
    event (one wait: the wrappers of one grouped request share it), then the tensors."""

    __slots__ = ("wrappers", "tensors")

    def __init__(self, wrappers: list[DeviceTensor], tensors: Sequence[torch.Tensor]) -> None:
        self.wrappers, self.tensors = wrappers, tensors

    def __call__(self, _result: Any) -> Sequence[torch.Tensor]:
        wait_done(self.wrappers, ())
        return self.tensors
