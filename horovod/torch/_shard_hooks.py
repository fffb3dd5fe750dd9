"""The hooks that drive a fully sharded module through an iteration (``install``):

- before its forward: wait for its parameters (gathering them if no prefetch did), register the
  unsharded ones, start gathering the next module of the previous iteration's order, cast floating
  inputs to ``mp_policy.param_dtype``;
- a wrapped submodule's forward when no iteration is open (called directly, not through the
  root's forward): start one; a layer holding the root's own parameters called directly: gather
  and register them for the call (kept to the end of backward, as the root's forward does);
- after its forward: register the shards again, free the unsharded parameters when
  ``reshard_after_forward`` (not the root's, nor those of a forward recomputed inside backward),
  put a hook on the outputs for the backward;
- before its backward (the outputs' gradient hook): queue the root's end-of-backward callback,
  gather its parameters again, prefetch the module before it in forward order;
- when each gradient of it has been accumulated: reduce-scatter them (``_shard_collectives``);
- at the end of backward (the root): reduce what is left, finish every reduction, agree on
  non-finite gradients, free every unsharded parameter, end the iteration (so does a forward
  under ``no_grad`` of the root, or of a submodule called directly with nothing awaiting a
  backward).
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
    # a forward that raises still pops the saved-tensor hooks its pre-hook pushed
    g.module.register_forward_hook(lambda m, a, out: _stop_saving(g), always_call=True)
    # the submodules that hold its parameters (a root's own layers: ``model.head``), for a call
    # that does not come through its forward
    owners = {id(mod): mod for q in g.params for mod, _ in q.owners if mod is not g.module}
    for mod in owners.values():
        mod.register_forward_pre_hook(lambda m, a: _owner_pre_forward(g))
        mod.register_forward_hook(lambda m, a, out: _owner_post_forward(g, out))


def _swap_in(g: ShardGroup) -> None:
    for q in g.params:
        q.use(q.unsharded)


def _swap_out(g: ShardGroup) -> None:
    for q in g.params:
        q.use(q.shard)


def _begin(root: ShardGroup) -> None:
    """Start an iteration: this one's order of forwards is the next one's guide for prefetching,
    and the collectives' names start again (the engine's response cache knows them)."""
    root.prev_order, root.order = (root.order or root.prev_order), []
    root.iteration += 1
    root.open = True
    root.grad_pending = False
    # the memory release counts what this iteration leaves free, not what was freed before it
    # (the optimizer's temporaries, another model's buffers: theirs to reuse, and handing them back
    # would make their next use fault them in again)
    root.released_idle = 1 << 62


def _pre_forward(g: ShardGroup, args: Any, kwargs: Any) -> Any:
    root = g.root()
    if root is g:
        if root.pending or root.callback_queued:  # a backward that did not finish its callback
            finish_backward(root)
        _begin(root)
        root.in_forward = True
    recompute = root.callback_queued and root is not g  # activation checkpointing in backward
    if not recompute and not root.open:
        # a wrapped submodule called directly, not through the root's forward (a Lightning
        # training_step calling self.encoder(x)): it starts the iteration
        _begin(root)
    if not recompute:
        root.order.append(g)
    _start_saving(g, root, recompute)
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
    _stop_saving(g)
    root = g.root()
    _swap_out(g)
    is_root = root is g
    if is_root:
        root.in_forward = False
    tensors, _ = tree_flatten(output)
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
    if not needs_grad:
        if is_root or not (root.in_forward or root.callback_queued or root.grad_pending):
            # no backward will come (the root's forward, or a submodule called directly, under
            # no_grad and with nothing of this iteration awaiting a backward): free everything
            # of this iteration and end it
            _end_without_backward(root)
        elif g.reshard_after_forward:
            reshard(g)
    else:
        root.grad_pending = True
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


class _SavedView:
    """What autograd keeps of a saved tensor that is a view of an unsharded parameter showing an
    allgather output: the parameter and the view's geometry, not the storage (which is freed after
    the forward and gathered anew, elsewhere, for the backward)."""

    __slots__ = ("g", "q", "offset", "size", "stride")

    def __init__(self, g: ShardGroup, q: Any, offset: Any, size: Any, stride: Any) -> None:
        self.g, self.q, self.offset, self.size, self.stride = g, q, offset, size, stride


def _saved_hooks(root: ShardGroup) -> tuple[Any, Any]:
    """The root's pack and unpack hooks (``torch.autograd.graph.saved_tensors_hooks``), pushed
    for the forward of each module that frees its parameters after it."""
    if root.saved_hooks is not None:
        return root.saved_hooks
    borrowed = root.borrowed

    def pack(t: torch.Tensor) -> Any:
        if t.layout != torch.strided or t.device.type == "meta":
            return t
        try:
            hit = borrowed.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage
            return t
        if hit is None or t.dtype != hit[1].unsharded.dtype:
            return t
        g, q = hit
        return _SavedView(g, q, t.storage_offset() - q.unsharded.storage_offset(), tuple(t.size()),
                          tuple(t.stride()))

    def unpack(s: Any) -> Any:
        if type(s) is not _SavedView:
            return s
        if not s.g.unsharded:  # read outside the module's backward (every rank alike)
            wait_unshard(s.g)
        u = s.q.unsharded.detach()
        return u.as_strided(s.size, s.stride, u.storage_offset() + s.offset)

    root.saved_hooks = (pack, unpack)
    return root.saved_hooks


# the innermost saved-tensor hooks in force (a private torch function: without it, every
# resharding module keeps its parameters' own storage, as if someone else's hooks were in force)
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _start_saving(g: ShardGroup, root: ShardGroup, recompute: bool) -> None:
    """Before ``g``'s forward (with autograd recording): under saved-tensor hooks of someone else
    (activation checkpointing, offloading) its parameters keep their own storage until this
    iteration's backward is done (those hooks may keep views of it); otherwise, for a module that
    frees its parameters after the forward, push ours, so that autograd keeps the parameters'
    views by parameter and the gathered output can be freed and gathered anew elsewhere."""
    if not torch.is_grad_enabled():
        return
    pack, unpack = _saved_hooks(root)
    top = _TOP_HOOKS(False) if _TOP_HOOKS is not None else (None, None)
    if top is not None and top[0] is not pack:
        g.own_storage_iteration = root.iteration
    elif top is None and not recompute and g is not root and g.reshard_after_forward and g.saving is None:
        g.saving = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        g.saving.__enter__()


def _stop_saving(g: ShardGroup) -> None:
    if g.saving is not None:
        saving, g.saving = g.saving, None
        saving.__exit__(None, None, None)


def _owner_pre_forward(g: ShardGroup) -> None:
    """A layer holding the root's own parameters called directly (not inside the root's forward):
    gather them as the root's forward would (kept to the end of backward) and register them for
    this call. Only the root's: a block's layers called without the block are not handled."""
    root = g.root()
    if root is not g or root.in_forward:
        return
    if not root.callback_queued:  # (in backward: a recompute, the iteration is the backward's)
        if not root.open:
            _begin(root)
        if all(h is not root for h in root.order):
            root.order.append(root)
            k = len(root.order)  # prefetch what came next the previous time
            if len(root.prev_order) > k and root.prev_order[k - 1] is root:
                start_unshard(root.prev_order[k])
    wait_unshard(root)
    _swap_in(root)


def _owner_post_forward(g: ShardGroup, output: Any) -> None:
    root = g.root()
    if root is not g or root.in_forward:
        return
    _swap_out(root)
    if root.callback_queued:
        return
    tensors, _ = tree_flatten(output)
    tensors = [t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad]
    if torch.is_grad_enabled() and tensors:
        root.grad_pending = True
        for t in tensors:
            t.register_hook(lambda grad: _pre_backward(root))
    elif not root.grad_pending:
        _end_without_backward(root)


def _end_without_backward(root: ShardGroup) -> None:
    for h in root.order:
        reshard(h)
    for h in root.prev_order:
        if h.gather is not None:
            reshard(h)
    root.open = False


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
    root.open = False  # the next forward, of the root or of a submodule, starts an iteration
