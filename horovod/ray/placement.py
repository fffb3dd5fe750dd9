"""Reserve resources for the workers (a Ray placement group) and number the ranks by node.

Ranks are numbered node by node (the nodes in the order their first worker appears), so the
ranks of one node are consecutive and ``local_rank``/``cross_rank`` come out as under
``horovodrun -H node1:2,node2:2``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from horovod.common import exceptions as errors

__all__ = ["NodeInfo", "PlacementTimeoutError", "reserve", "group_by_node", "node_labels", "resources_text",
           "shared_visible_devices"]

log = logging.getLogger("horovod.ray")


class PlacementTimeoutError(errors.LaunchError, TimeoutError):
    """The cluster could not give the workers' resources within ``placement_group_timeout_s``.

    A ``TimeoutError``, as upstream raises, and a ``LaunchError`` like every other start failure.
    """


@dataclass(frozen=True)
class NodeInfo:
    """Where one worker actor runs."""

    node_id: str
    ip: str
    hostname: str
    pid: int


def resources_text() -> str:
    """The cluster's CPUs/GPUs, in total and free, for error messages."""
    import ray

    total, free = ray.cluster_resources(), ray.available_resources()
    nodes = [n for n in ray.nodes() if n.get("Alive", n.get("alive"))]
    text = f"{total.get('CPU', 0):g} CPU(s) in total, {free.get('CPU', 0):g} free"
    if total.get("GPU"):
        text += f"; {total['GPU']:g} GPU(s), {free.get('GPU', 0):g} free"
    return f"{text}, on {len(nodes)} node(s)"


def reserve(bundles: list[dict[str, float]], strategy: str, timeout_s: float, what: str) -> Any:
    """Create a placement group and wait until it is placed.

    Raises:
        PlacementTimeoutError: it could not be placed within ``timeout_s`` (the group is removed
            again; the message says what was asked for and what the cluster has).
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if ready:
        return pg
    have = resources_text()
    remove_placement_group(pg)
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0) + v
    need_text = ", ".join(f"{v:g} {k}" for k, v in need.items() if v)
    raise PlacementTimeoutError(
        f"RayExecutor: could not reserve {what} ({need_text} in {len(bundles)} bundle(s), "
        f"strategy {strategy}) within placement_group_timeout_s={timeout_s:g} s; the cluster has "
        f"{have}. Lower num_workers or cpus_per_worker, add nodes to the cluster, or raise "
        "placement_group_timeout_s (RayExecutor.create_settings).",
        needed=need, strategy=strategy, timeout=timeout_s)


def group_by_node(infos: Sequence[NodeInfo]) -> list[int]:
    """The worker indices in rank order: node by node, nodes in order of first appearance."""
    order: dict[str, list[int]] = {}
    for i, info in enumerate(infos):
        order.setdefault(info.node_id, []).append(i)
    return [i for idxs in order.values() for i in idxs]


def node_labels(infos: Sequence[NodeInfo]) -> dict[str, str]:
    """A readable, unique name per node id: its IP, plus the id's start where IPs repeat
    (several Ray nodes on one machine)."""
    ips: dict[str, set[str]] = {}
    for info in infos:
        ips.setdefault(info.ip, set()).add(info.node_id)
    return {info.node_id: info.ip if len(ips[info.ip]) == 1 else f"{info.ip}-{info.node_id[:8]}"
            for info in infos}


def shared_visible_devices(nodes: Sequence[str], gpu_ids: Sequence[Sequence[Any]]) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` per rank: every GPU Ray gave the ranks of its node, in rank order.

    Ray shows each actor only its own GPUs; Horovod's recipe pins ``hvd.local_rank()`` as the
    device index, so (as upstream does) every rank of a node sees the node's GPUs of the job.
    ``nodes[r]`` is rank r's node, ``gpu_ids[r]`` the GPU ids Ray gave it.
    """
    per_node: dict[str, list[str]] = {}
    for node, ids in zip(nodes, gpu_ids):
        seen = per_node.setdefault(node, [])
        seen += [str(i) for i in ids if str(i) not in seen]
    return [",".join(per_node[node]) for node in nodes]
