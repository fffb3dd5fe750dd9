"""Rank numbers of a job: global, local (on this host) and cross (across hosts). Pure functions."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Topology", "topology_from_hostnames"]


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    is_homogeneous: bool
    hostnames: tuple[str, ...]


def topology_from_hostnames(hostnames: list[str] | tuple[str, ...], rank: int) -> Topology:
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
    return Topology(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=counts[me],
        cross_rank=cross_hosts.index(me),
        cross_size=len(cross_hosts),
        is_homogeneous=len(set(counts.values())) == 1,
        hostnames=tuple(hostnames),
    )
