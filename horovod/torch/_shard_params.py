"""What ``hvd.fully_shard`` keeps of each parameter it shards: its row layout over the ranks, its
shard (the registered ``nn.Parameter``) and its unsharded tensor, the flat per-rank segment the
shards are views of, and the tables that map torch objects to this state (kept here rather than as
attributes on them, keyed by identity, never keeping an object alive).

Layout: with R rows (dimension 0; a 0-d parameter counts as one row) over N ranks, rank r keeps
rows ``[r*c, min(R, (r+1)*c))`` with ``c = ceil(R/N)``; each parameter has a slot of ``c`` rows in
every rank's segment (its ``offset``), so that one allgather of the segments holds every
parameter whole (padded per rank).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from horovod.common.process_sets import ProcessSet
from horovod.torch import mpi_ops

__all__ = ["ShardedParam", "flatten_shards", "gather_rows", "GROUPS", "SHARD_NAMES", "SHARDED_AS"]

# a wrapped module -> its ShardGroup (horovod/torch/_shard_group.py)
GROUPS: Any = WeakIdKeyDictionary()
# a shard -> the name of its parameter
SHARD_NAMES: Any = WeakIdKeyDictionary()
# an original parameter that a call sharded -> what it became (a later call sees a tie to it)
SHARDED_AS: Any = WeakIdKeyDictionary()


class ShardedParam:
    """One managed parameter: its shard (the registered nn.Parameter) and its unsharded tensor."""

    def __init__(self, fqn: str, owners: list[tuple[torch.nn.Module, str]], full: torch.nn.Parameter,
                 n: int, r: int, compute_dtype: torch.dtype, offset: int) -> None:
        self.fqn, self.owners = fqn, owners
        self.shape = tuple(full.shape)
        self.dtype = full.dtype
        self.rows = self.shape[0] if self.shape else 1
        self.row_numel = math.prod(self.shape[1:]) if self.shape else 1
        self.lay_out(n, r, offset)
        data = full.detach().reshape(self.rows, *self.shape[1:])[self.lo:self.hi].clone()
        self.shard = torch.nn.Parameter(data, requires_grad=full.requires_grad)
        SHARD_NAMES[self.shard] = fqn
        self.unsharded = torch.nn.Parameter(torch.empty(self.shape, dtype=compute_dtype, device=full.device),
                                            requires_grad=full.requires_grad)
        # the unsharded parameter's own storage (resized to 0 when freed): what it shows when it
        # must keep one storage from forward to backward; otherwise it shows the allgather's output
        # itself (``borrowed``: no copy, freed by dropping it)
        self.own = self.unsharded.data
        self.borrowed = False
        self.numel = self.unsharded.numel()
        self.nbytes = self.numel * self.unsharded.element_size()
        self.free()

    def lay_out(self, n: int, r: int, offset: int) -> int:
        """Rank ``r``'s rows over ``n`` ranks, the slot at ``offset`` of a segment; returns the
        offset of the next parameter's slot."""
        self.chunk_rows = -(-self.rows // n)
        self.seg = self.chunk_rows * self.row_numel  # this parameter's slot per rank
        self.offset = offset                          # the slot's offset in a segment
        self.lo = min(self.rows, r * self.chunk_rows)
        self.hi = min(self.rows, (r + 1) * self.chunk_rows)
        return offset + self.seg

    @property
    def local_numel(self) -> int:
        return (self.hi - self.lo) * self.row_numel

    def _unborrow(self) -> None:
        if self.borrowed:  # drop the allgather's output: show the own storage again
            self.unsharded.data = self.own
            self.borrowed = False

    def free(self) -> None:
        self._unborrow()
        self.own.untyped_storage().resize_(0)

    def show(self, full: torch.Tensor, own: bool) -> None:
        """Make the unsharded parameter hold ``full`` (the whole parameter, a view of the
        allgather's output): copied into its own storage when ``own``, else shown as it is."""
        if own:
            self._unborrow()
            st = self.own.untyped_storage()
            if st.size() != self.nbytes:
                st.resize_(self.nbytes)
            self.own.copy_(full)
        else:
            self.unsharded.data = full
            self.borrowed = True

    def allocated(self) -> bool:
        return self.unsharded.data.untyped_storage().size() > 0

    def use(self, which: torch.nn.Parameter) -> None:
        """Register ``which`` (the shard or the unsharded parameter) under every name of it."""
        for mod, name in self.owners:
            mod._parameters[name] = which


def flatten_shards(params: list[ShardedParam], segment: int) -> torch.Tensor | None:
    """Make the shards views of one flat per-rank segment of ``segment`` elements (the allgather's
    input as it is, padding included), keeping their values, and return it; None when they do not
    share a dtype (the allgather then copies them into a segment)."""
    if not params or len({q.dtype for q in params}) != 1:
        return None
    flat = torch.zeros(segment, dtype=params[0].dtype, device=params[0].shard.device)
    for q in params:
        view = flat[q.offset:q.offset + q.local_numel].view(q.shard.shape)
        view.copy_(q.shard.data)
        q.shard.data = view
    return flat


def gather_rows(v: torch.Tensor, q: ShardedParam, ps: ProcessSet, name: str) -> torch.Tensor:
    """The whole tensor from every rank's rows ``v`` (shape of ``q.shard``)."""
    n = ps.size() or 1
    send = torch.zeros(q.seg, dtype=v.dtype, device=v.device)
    send[:v.numel()].copy_(v.detach().reshape(-1))
    out = mpi_ops.synchronize(mpi_ops.allgather_async(send, name=f"hvd.fully_shard.{name}", process_set=ps))
    return out.view(n, q.seg).reshape(-1)[:q.rows * q.row_numel].view(q.shape).clone()
