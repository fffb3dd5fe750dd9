"""Hierarchical allreduce and allgather over the hosts of one process set.

``HOROVOD_HIERARCHICAL_ALLREDUCE``: a buffer is reduce-scattered within each host (every local
rank ends with the host's sum of one shard), each shard is allreduced across hosts among the
ranks with the same local index (one cross group per local index, all working at once), and the
shards are allgathered within the host. This is the variant upstream uses for NCCL
(reduce-scatter / allreduce / allgather) rather than reduce / allreduce / broadcast: every local
rank carries 1/local_size of the cross-host traffic instead of one rank carrying all of it.

``HOROVOD_HIERARCHICAL_ALLGATHER``: the pieces are gathered within each host, the hosts' blocks
are allgathered across hosts among the hosts' first local ranks, and the whole result is
broadcast within each host (upstream's scheme).

Both need every host of the set to run the same number of its ranks (as upstream); otherwise,
or when the set lies on one host or has one rank per host, the flat collective runs instead.
Groups are made once per process set, from the set's own communicator (only its members take
part), by ``backend.split_group``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from horovod.common.backends.base import Group, SplitsGroups
from horovod.common.types import ReduceOp

__all__ = ["Hierarchy", "host_layout"]


def host_layout(ranks: Sequence[int], hostnames: Sequence[str]) -> tuple[list[int], list[int]] | None:
    """(host index, local index) of every member of a set, or None if hierarchy does not apply.

    Hosts are numbered in order of their first member. None when the set has one host, one member
    per host, or hosts with different numbers of members.
    """
    host_of: dict[str, int] = {}
    counts: list[int] = []
    hosts, locals_ = [], []
    for r in ranks:
        h = hostnames[r]
        if h not in host_of:
            host_of[h] = len(counts)
            counts.append(0)
        hosts.append(host_of[h])
        locals_.append(counts[host_of[h]])
        counts[host_of[h]] += 1
    if len(counts) < 2 or counts[0] < 2 or len(set(counts)) != 1:
        return None
    return hosts, locals_


class Hierarchy:
    """The local (same host) and cross (same local index) groups of one process set, and the
    hierarchical collectives over them."""

    def __init__(self, backend: SplitsGroups, group: Group, hosts: list[int], local_idx: list[int]) -> None:
        self.backend = backend
        self.group = group
        me = group.rank
        self.hosts = hosts
        self.local_idx = local_idx
        self.local_size = hosts.count(hosts[me])
        self.n_hosts = max(hosts) + 1
        # Every member takes part in both splits, in the same order.
        self.local = backend.split_group(group, hosts)
        self.cross = backend.split_group(group, local_idx)
        # Members in (host, local index) order, as the hierarchical allgather lays them out.
        self.order = sorted(range(group.size), key=lambda i: (hosts[i], local_idx[i]))
        self.contiguous = self.order == list(range(group.size))
        self._scratch: dict[str, np.ndarray] = {}

    def _buffer(self, dtype: np.dtype, n: int) -> np.ndarray:
        buf = self._scratch.get(dtype.str)
        if buf is None or buf.size < n:
            buf = np.empty(max(n, 1024), dtype)
            self._scratch[dtype.str] = buf
        return buf[:n]

    def allreduce(self, buf: np.ndarray, op: ReduceOp) -> None:
        """Reduce ``buf`` (flat, contiguous) in place over the whole set."""
        n = buf.size
        if n == 0:
            return
        base, extra = divmod(n, self.local_size)
        counts = [base + (1 if i < extra else 0) for i in range(self.local_size)]
        mine = counts[self.local.rank]
        shard = self._buffer(buf.dtype, mine)
        self.backend.reducescatter(buf, shard, counts, op, self.local)
        self.backend.allreduce(shard, op, self.cross)
        self.backend.allgatherv(shard, buf, counts, self.local)

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
        """Gather every member's ``send`` (``counts[i]`` elements from member i) into ``recv``."""
        g = self.group
        members_here = [i for i in range(g.size) if self.hosts[i] == self.hosts[g.rank]]
        local_counts = [counts[i] for i in members_here]
        host_block = self._buffer(recv.dtype, sum(local_counts))
        self.backend.allgatherv(send, host_block, local_counts, self.local)
        out = recv if self.contiguous else np.empty_like(recv)
        if self.local.rank == 0:  # the hosts' first ranks exchange the host blocks
            block_counts = [sum(counts[i] for i in range(g.size) if self.hosts[i] == h)
                            for h in range(self.n_hosts)]
            self.backend.allgatherv(host_block, out, block_counts, self.cross)
        self.backend.broadcast(out, 0, self.local)
        if not self.contiguous:  # from (host, local index) order back to the set's order
            offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            pos = 0
            for i in self.order:
                recv[offsets[i]:offsets[i] + counts[i]] = out[pos:pos + counts[i]]
                pos += counts[i]
