"""The hooks that drive a fully sharded module through an iteration (``install``):

- before its forward: wait for its parameters (gathering them if no prefetch did), register the
  unsharded ones, start gathering the next module of the previous iteration's order, cast floating
  inputs to ``mp_policy.param_dtype``;
- after its forward: register the shards again, free the unsharded parameters when
  ``reshard_after_forward`` (not the root's, nor those of a forward recomputed inside backward),
  put a hook on the outputs for the backward;
- before its backward (the outputs' gradient hook): queue the root's end-of-backward callback,
  gather its parameters again, prefetch the module before it in forward order;
- when each gradient of it has been accumulated: reduce-scatter them (``_shard_collectives``);
- at the end of backward (the root): reduce what is left, finish every reduction, agree on
  non-finite gradients, free every unsharded parameter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from horovod.torch._shard_collectives import agree_finite, complete, reduce, reshard, start_unshard, wait_unshard
from horovod.torch._shard_group import ShardGroup

__all__ = ["install", "finish_backward"]


def install(g: ShardGroup) -> None:
    """Put ``g``'s hooks on its module and on its unsharded parameters."""
    for i, q in enumerate(g.params):
        if q.unsharded.requires_grad:
            q.unsharded.register_post_accumulate_grad_hook(_grad_hook(g, i))
    g.module.register_forward_pre_hook(lambda m, a, k: _pre_forward(g, a, k), with_kwargs=True)
    g.module.register_forward_hook(lambda m, a, k, out: _post_forward(g, out), with_kwargs=True)


def _swap_in(g: ShardGroup) -> None:
    for q in g.params:
        q.use(q.unsharded)


def _swap_out(g: ShardGroup) -> None:
    for q in g.params:
        q.use(q.shard)


def _pre_forward(g: ShardGroup, args: Any, kwargs: Any) -> Any:
    root = g.root()
    if root is g:
        if root.pending or root.callback_queued:  # a backward that did not finish its callback
            finish_backward(root)
        root.prev_order, root.order = (root.order or root.prev_order), []
        root.iteration += 1
        root.in_forward = True
    recompute = root.callback_queued and root is not g  # activation checkpointing in backward
    if not recompute:
        root.order.append(g)
    wait_unshard(g)
    _swap_in(g)
    # prefetch the next module of the previous iteration's order
    k = len(root.order)
    if not recompute and len(root.prev_order) > k and root.prev_order[k - 1] is g:
        start_unshard(root.prev_order[k])
    if g.mp.param_dtype is not None and g.mp.cast_forward_inputs:
        dt = g.mp.param_dtype
        cast = lambda t: t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
        args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
    return args, kwargs


def _post_forward(g: ShardGroup, output: Any) -> Any:
    root = g.root()
    _swap_out(g)
    is_root = root is g
    if is_root:
        root.in_forward = False
    tensors, _ = tree_flatten(output)
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
    if not needs_grad:
        if is_root:  # no backward will come: free everything of this iteration
            for h in root.order:
                reshard(h)
            for h in root.prev_order:
                if h.gather is not None:
                    reshard(h)
        elif g.reshard_after_forward:
            reshard(g)
    else:
        # a forward recomputed inside backward (activation checkpointing) keeps its parameters
        # for the backward that follows at once
        if g.reshard_after_forward and not is_root and not root.callback_queued:
            reshard(g)
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad: _pre_backward(g))
    if g.mp.output_dtype is not None:
        dt = g.mp.output_dtype
        output = tree_map(lambda t: t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point()
                          else t, output)
    return output


def _pre_backward(g: ShardGroup) -> None:
    root = g.root()
    if not root.callback_queued:
        root.callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(lambda: finish_backward(root))
    if not g.unsharded:
        wait_unshard(g)
    # prefetch the module before this one in forward order
    order = root.order
    for i in range(len(order) - 1, 0, -1):
        if order[i] is g:
            prev = order[i - 1]
            if not prev.unsharded and prev.gather is None and prev.n_grad:
                start_unshard(prev)
            break


def _grad_hook(g: ShardGroup, i: int) -> Any:
    def hook(p: torch.Tensor) -> None:
        if not g.requires_sync:
            return
        g.accumulated.add(i)
        if len(g.accumulated) == g.n_grad:
            reduce(g)
    return hook


def finish_backward(root: ShardGroup) -> None:
    """At the end of backward (on the root): reduce what is left, add each rank's part to the
    shards' gradients, free every unsharded parameter."""
    assert root.owner is None
    root.callback_queued = False
    for g in root.order:
        if g.requires_sync and g.accumulated:
            reduce(g)
    pending, root.pending = root.pending, []
    for entry in pending:
        complete(*entry)
    if pending:  # this backward reduced (every rank alike)
        agree_finite(root)
    for g in root.order:
        reshard(g)
    for g in root.prev_order:
        if g.gather is not None:
            reshard(g)
