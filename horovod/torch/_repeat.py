"""Resubmitting a checked request as it is: the fast path of an in-place operation repeated every
step on tensors of the same signature (a gradient hook, a metric averaged by hand, a grouped
gradient set).

The first call of a named in-place allreduce takes the checked path; it leaves a *repeat
signature* (``_repeat_signature``): the request, the context and process set it was checked in,
the tensor's dtype and shape. A later call whose tensor still matches resubmits that request on
the tensor's memory (``_resubmit``; ``_resubmit_many`` for a backward pass's gradients under one
handle; ``_GroupRepeat`` for a grouped call), skipping the checks, conversions and the request's
construction. Anything else takes the checked path again.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from horovod.common import collectives as _C
from horovod.common.context import get_context, peek_context
from horovod.common.types import ReduceOp
from horovod.torch import _convert as _cv


class _Same:
    """A handle's post step that returns the tensor reduced in place (and keeps it alive)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __call__(self, _result: Any) -> torch.Tensor:
        return self.tensor


# Named in-place allreduces repeated with the same arguments (a metric averaged every step, a
# gradient reduced by hand): (name, op, factors, process set) -> ``_repeat_signature``. A repeat
# whose tensor still matches resubmits the checked request as it is (``_resubmit``), skipping the
# checks and conversions; anything else takes the checked path. Bounded: cleared when full (names
# made fresh every step would only grow it). The optimizer's gradient hooks keep their own
# per-parameter signatures.
_REPEAT: dict[tuple[Any, ...], Any] = {}  # a signature, or a _GroupRepeat
_REPEAT_MAX = 4096


def _repeat_signature(tensor: torch.Tensor, req: Any) -> tuple[Any, ...] | None:
    """What a later resubmission of ``req`` checks its tensor against, or None when ``req`` (just
    submitted with ``tensor``, in place) may not be resubmitted unchecked: only host-path,
    non-Adasum reductions of contiguous tensors NumPy views directly."""
    if (req.device != "cpu" or req.reduce_op == ReduceOp.ADASUM or tensor.dtype not in _cv.DIRECT_DTYPES
            or not tensor.is_contiguous() or tensor.requires_grad):
        return None
    ctx = get_context()
    group = ctx.groups.get(req.process_set_id)
    dtype, shape = tensor.dtype, tensor.shape
    # (context, request, dtype, shape, group, the tensor's expected _PROBE, where it was checked)
    return (ctx, req, dtype, shape, group, (dtype, shape, False, torch.strided, True),
            (ctx, req.process_set_id, group))


# What a resubmitted tensor must still be, read for many tensors at once (C loops): its dtype,
# shape, no autograd, dense, on the host (``_repeat_signature``'s sixth item); and contiguous.
_PROBE = operator.attrgetter("dtype", "shape", "requires_grad", "layout", "is_cpu")
_CONTIGUOUS = operator.methodcaller("is_contiguous")
_DATA_PTR = operator.methodcaller("data_ptr")
_PROBE_OF = operator.itemgetter(5)
_HOME_OF = operator.itemgetter(6)


def _resubmit(tensor: Any, signature: tuple[Any, ...], wake: bool = True, defer: bool = False) -> int | None:
    """Resubmit the request of ``signature`` on ``tensor`` in place when the tensor still matches
    it (dtype, shape, context, process set, a plain dense CPU tensor); None when it does not."""
    # _matches(tensor, signature), inlined: this runs once per gradient per step.
    ctx, req, dtype, shape, group, _probe, _home = signature
    if (type(tensor) is torch.Tensor and tensor.dtype is dtype and tensor.shape == shape
            and ctx is peek_context() and ctx is not None and ctx.groups.get(req.process_set_id) is group
            and not tensor.requires_grad and tensor.layout is torch.strided and tensor.is_cpu
            and tensor.is_contiguous()):
        return _C.resubmit_registered(ctx, req, [tensor.numpy()], _Same(tensor), defer, wake)
    return None


class _Each:
    """A bundle handle's post step: the tensors reduced in place (and keeps them alive)."""

    __slots__ = ("tensors",)

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = tensors

    def __call__(self, _result: Any) -> Sequence[torch.Tensor]:
        return self.tensors


def _resubmit_many(tensors: list[torch.Tensor], signatures: list[tuple[Any, ...]], defer: bool = False,
                   wake: bool = True) -> int | None:
    """``_resubmit`` for many tensors with one handle (``collectives.resubmit_many``): a backward
    pass's gradients. None, submitting nothing, unless every tensor still matches its signature
    and all signatures share the live context."""
    ctx = peek_context()
    if ctx is None or not tensors or not _all_match(ctx, tensors, signatures):
        return None
    arrays = [t.numpy() for t in tensors]
    return _C.resubmit_many(ctx, [s[1] for s in signatures], arrays, _Each(tensors), defer, wake)


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


def _matches(tensor: Any, signature: tuple[Any, ...]) -> bool:
    """``tensor`` may be resubmitted with ``signature``'s request (what ``_resubmit`` inlines)."""
    ctx = peek_context()
    return ctx is not None and _all_match(ctx, [tensor], [signature])


def _remember(key: tuple[Any, ...], signature: Any) -> None:
    if len(_REPEAT) >= _REPEAT_MAX:
        _REPEAT.clear()
    _REPEAT[key] = signature


class _GroupRepeat:
    """A named in-place grouped allreduce repeated with the same arguments: its tensors'
    signatures, and the tensors of the last repeat with their NumPy views.

    ``views`` returns the views to resubmit, or None when the tensors no longer match (the caller
    takes the checked path). The same tensor objects as last time (a fixed gradient or metric
    set) reuse last time's views after a check of what could have changed in place (data
    pointer, dtype, shape, layout, autograd, contiguity), without making new views; other
    tensors are checked like any resubmission (``_all_match``) and become the remembered ones.
    The same list of views is handed to the engine each time, so its per-entry work is reused
    too (``NumpyBuffers.items``). The last tensors stay referenced until the name's next call
    (or until ``_REPEAT`` is cleared when full): one set per name, as the caller's own."""

    __slots__ = ("signatures", "request", "probes", "tensors", "arrays", "ptrs", "post")

    def __init__(self, signatures: tuple[tuple[Any, ...], ...]) -> None:
        self.signatures = signatures
        self.request = signatures[0][1]
        self.probes = list(map(_PROBE_OF, signatures))
        self.tensors: tuple[torch.Tensor, ...] = ()
        self.arrays: list[np.ndarray] = []
        self.ptrs: list[int] = []
        self.post: Callable[[Any], Any] = _Each([])

    def views(self, ctx: Any, tensors: Sequence[Any]) -> list[np.ndarray] | None:
        last = self.tensors
        if len(tensors) == len(last) and all(map(operator.is_, tensors, last)):
            sctx, ps_id, group = self.signatures[0][6]
            if (sctx is ctx and ctx.groups.get(ps_id) is group
                    and list(map(_DATA_PTR, tensors)) == self.ptrs
                    and list(map(_PROBE, tensors)) == self.probes and all(map(_CONTIGUOUS, tensors))):
                return self.arrays
        if not _all_match(ctx, tensors, self.signatures):
            return None
        self.tensors = tuple(tensors)
        self.arrays = [t.numpy() for t in self.tensors]
        self.ptrs = list(map(_DATA_PTR, self.tensors))
        self.post = _Each(self.tensors)
        return self.arrays
