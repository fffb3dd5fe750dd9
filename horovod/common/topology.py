"""Rank numbers of a job: global, local (on this host) and cross (across hosts). Pure functions."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from horovod.common.protocol import RankIdentity

__all__ = ["topology_from_hostnames", "homogeneous"]


def topology_from_hostnames(hostnames: Sequence[str], rank: int) -> RankIdentity:
    """Derive local and cross ranks from every rank's host name (index = global rank).

    Local rank is the index of a process among the processes of its host, in global-rank order.
    The cross communicator of a process joins the processes that have the same local rank on
    every host (hosts ordered by their first global rank), as in upstream Horovod: with two hosts
    running 2 and 1 processes, local rank 0 sees ``cross_size == 2`` and local rank 1 sees 1.

    Raises:
        ValueError: ``rank`` is not an index of ``hostnames``.
    """
    size = len(hostnames)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside the job of size {size}")
    host_order: list[str] = []
    counts: dict[str, int] = {}
    local_ranks: list[int] = []
    for h in hostnames:
        if h not in counts:
            host_order.append(h)
            counts[h] = 0
        local_ranks.append(counts[h])
        counts[h] += 1
    me = hostnames[rank]
    local_rank = local_ranks[rank]
    cross_hosts = [h for h in host_order if counts[h] > local_rank]
    return RankIdentity(hostname=me, rank=rank, local_rank=local_rank,
                        cross_rank=cross_hosts.index(me), size=size, local_size=counts[me],
                        cross_size=len(cross_hosts))


def homogeneous(hostnames: Sequence[str]) -> bool:
    """True when every host runs the same number of processes."""
    return len(set(Counter(hostnames).values())) <= 1
