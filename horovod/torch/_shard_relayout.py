"""A fully sharded module laid out again over its process set's current size and rank (after an
elastic reset: ``hvd.elastic.TorchState`` calls ``relayout`` on every rank of the new set, then
loads the committed full state)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from horovod.torch._shard_collectives import reshard
from horovod.torch._shard_group import ShardGroup
from horovod.torch._shard_params import GROUPS, flatten_shards

__all__ = ["relayout"]


def relayout(groups: Iterable[Any]) -> bool:
    """Lay the shards of ``groups`` (fully sharded modules, or their groups) out again over their
    process set's current size and this rank's current rank there (after an elastic reset): each
    shard keeps its ``nn.Parameter`` object (an optimizer's references stay valid) and gets its
    new rows, zero until a full state dict is loaded; gradients and the iteration's order are
    dropped. Returns whether anything changed. Every rank of the new set must call it."""
    changed = False
    for g in groups:
        g = GROUPS[g] if isinstance(g, torch.nn.Module) else g
        changed = _relayout_group(g) or changed
    return changed


def _relayout_group(g: ShardGroup) -> bool:
    n, r = g.process_set.size() or 1, g.process_set.rank() or 0
    if (n, r) == (g.n, g.r):
        return False
    reshard(g)
    g.n, g.r = n, r
    g.order, g.prev_order, g.pending = [], [], []
    g.callback_queued, g.in_forward, g.open, g.grad_pending = False, False, False, False
    g.release_slack, g.released_idle = 0, 1 << 62  # the modules' buffers have other sizes now
    g.accumulated.clear()
    g.direct = None  # the rows' split is another
    offset = 0
    for q in g.params:
        offset = q.lay_out(n, r, offset)
        q.shard.grad = None
        q.shard.data = torch.zeros((q.hi - q.lo, *q.shape[1:]), dtype=q.dtype, device=q.shard.device)
    g.segment = offset
    g.flat = flatten_shards(g.params, offset)
    return True
