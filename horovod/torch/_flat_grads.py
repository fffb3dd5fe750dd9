"""Gradients kept as views of one flat buffer, reduced in buckets (DDP's ``gradient_as_bucket_view``).

``DistributedOptimizer`` (``DenseReducer``) lays the gradients of its CPU parameters out end to end
in one flat buffer per dtype, last parameters first (the order backward produces them), and cuts
the layout into buckets of up to ``BUCKET_BYTES``. Each bucket is one grouped in-place allreduce
whose tensors lie end to end, so the engine reduces it as one span where it lies, without packing
copies and in as few transport calls as the span needs (docs/engine.md, ``Request.flat``).

A gradient that autograd created afresh (after ``zero_grad(set_to_none=True)``) is copied into its
view once, in its hook, and the view becomes ``p.grad``; a gradient that is already the view (after
``zero_grad(set_to_none=False)``, or a later backward pass of an accumulation) is accumulated into
by autograd directly. A buffer of 4 MiB or more starts on a 2 MiB boundary on transparent huge
pages (``_convert.huge_page_zeros``), so the engine reduces its buckets where they lie over whole
huge pages, as it does its own fusion buffers, whatever the launcher. The buckets depend only on
the parameters (their order, shapes and dtypes), never on the rank's machine, so every rank
submits the same grouped requests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from horovod.torch._convert import huge_page_zeros

__all__ = ["BUCKET_BYTES", "flat_buckets", "adopt"]

# DDP's default bucket_cap_mb: a model of up to 25 MiB of gradients is one bucket (one span).
BUCKET_BYTES = 25 * 1024 * 1024


def _eligible(p: torch.Tensor) -> bool:
    return (p.requires_grad and p.device.type == "cpu" and p.layout == torch.strided
            and p.dtype.is_floating_point and p.numel() > 0)


def flat_buckets(params: list[torch.Tensor], bucket_bytes: int = BUCKET_BYTES,
                 alloc: Callable[[int, torch.dtype], torch.Tensor] = huge_page_zeros,
                 ) -> tuple[list[tuple[torch.Tensor, ...]], dict[torch.Tensor, torch.Tensor]]:
    """Buckets over ``params`` (parameter order; those requiring a gradient) and each eligible
    parameter's view of its dtype's flat buffer.

    Returns ``(groups, views)``: every parameter requiring a gradient is in exactly one group; a
    bucket of eligible parameters (CPU, dense, floating point) lists them in the order they lie in
    the buffer (reverse parameter order), every other parameter is a group of its own.
    ``alloc(numel, dtype)`` makes each dtype's zeroed flat buffer.
    """
    wanted = [p for p in params if p.requires_grad]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    groups: list[tuple[torch.Tensor, ...]] = []
    for p in reversed(wanted):
        if _eligible(p):
            by_dtype.setdefault(p.dtype, []).append(p)
    views: dict[torch.Tensor, torch.Tensor] = {}
    for dtype, ps in by_dtype.items():
        flat = alloc(sum(p.numel() for p in ps), dtype)
        offset, used = 0, 0
        bucket: list[torch.Tensor] = []
        size = flat.element_size()
        for p in ps:
            n = p.numel()
            if bucket and used + n * size > bucket_bytes:
                groups.append(tuple(bucket))
                bucket, used = [], 0
            views[p] = flat[offset:offset + n].view(p.shape)
            bucket.append(p)
            used += n * size
            offset += n
        if bucket:
            groups.append(tuple(bucket))
    groups += [(p,) for p in wanted if p not in views]
    return groups, views


def adopt(p: torch.Tensor, view: torch.Tensor) -> None:
    """Make ``view`` the gradient of ``p`` (``p.grad`` copied into it, or zeros where ``p`` has
    none), unless it already is. A sparse gradient stays as it is (it is reduced densified)."""
    grad = p.grad
    if grad is view or p.shape != view.shape or p.dtype != view.dtype:
        return  # already there, or the parameter itself changed (``p.data = ...``): left as it is
    if grad is None:
        view.zero_()
    elif grad.is_sparse or grad.shape != view.shape or grad.dtype != view.dtype:
        return
    else:
        view.copy_(grad)
    p.grad = view

