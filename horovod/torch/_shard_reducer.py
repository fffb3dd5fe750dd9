"""The ``GradientReducer`` (``horovod/torch/reducer.py``) of a fully sharded model:
``FullyShardedReducer``, one per root module (``reducer_for``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from horovod.torch._clip import clip_by_global_norm
from horovod.torch._shard_collectives import reshard
from horovod.torch._shard_group import ShardGroup, groups_in
from horovod.torch._shard_hooks import finish_backward
from horovod.torch._shard_params import GROUPS
from horovod.torch.reducer import PassesPerStep, SkipSynchronize

__all__ = ["FullyShardedReducer", "reducer_for"]


class FullyShardedReducer(PassesPerStep, SkipSynchronize):
    """The ``GradientReducer`` of a fully sharded model, for a plain optimizer over its shards
    (ZeRO stage 3): the reduce-scatters are the wrapped modules' own, run in backward, so a
    step's gradients are in the shards by the end of backward; this object only lets code written
    for the protocol (the Lightning strategy, ``clip_grad_norm_``) drive it.
    ``backward_passes_per_step`` > 1 is gradient accumulation through
    ``set_requires_gradient_sync`` (only the last pass of a window reduces): the caller turns
    sync off for the other passes (``accumulating(last)``)."""

    def __init__(self, module: Any) -> None:
        if module not in GROUPS:
            raise ValueError(f"FullyShardedReducer: {type(module).__name__} is not fully sharded "
                             "(call hvd.fully_shard on it, its root module last)")
        self.module = module

    @property
    def _root(self) -> ShardGroup:
        return GROUPS[self.module].root()

    def accumulating(self, last: bool) -> None:
        """Whether the next backward pass reduces (``last`` of an accumulation window) or only
        accumulates the unsharded gradients locally."""
        for g in groups_in(self.module):
            g.requires_sync = bool(last)

    def register_hooks(self) -> None:
        """Nothing to add: the wrapped modules' hooks (``fully_shard``) reduce."""

    def remove_hooks(self) -> None:
        """Nothing to remove (see ``register_hooks``)."""

    def pending(self) -> bool:
        root = self._root
        return bool(root.pending) or root.callback_queued or any(g.accumulated for g in groups_in(self.module))

    def synchronize(self) -> None:
        """Finish a backward whose end-of-backward callback did not run (reductions left in
        flight); nothing to do after a complete backward pass. Repeated calls do nothing."""
        if self.pending():
            finish_backward(self._root)

    def check_idle(self) -> None:
        if self._root.pending:
            raise AssertionError("fully sharded gradients are being reduce-scattered; finish "
                                 "backward() (or call synchronize()) before zero_grad()")

    def reset(self) -> None:
        root = self._root
        root.pending, root.callback_queued, root.open = [], False, False
        for g in groups_in(self.module):
            g.accumulated.clear()
            for q in g.params:
                q.unsharded.grad = None
            reshard(g)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the shards' gradients by the norm of the whole gradient (one allreduce)."""
        self.synchronize()
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        return clip_by_global_norm(grads, grads, max_norm, norm_type, GROUPS[self.module].process_set,
                                   "hvd.fully_shard", error_if_nonfinite)


_REDUCERS: Any = WeakIdKeyDictionary()


def reducer_for(module: Any) -> FullyShardedReducer:
    """The ``FullyShardedReducer`` of a fully sharded root module (one per module)."""
    r = _REDUCERS.get(module)
    if r is None:
        r = _REDUCERS[module] = FullyShardedReducer(module)
    return r
