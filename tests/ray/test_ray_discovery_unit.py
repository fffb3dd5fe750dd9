"""``RayHostDiscovery`` on ``ray.nodes()`` entries with and without ``NodeID`` (upstream's tests
give entries without it); no cluster is started."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'horovod-py[ray]')")


def _discover(monkeypatch, nodes, **kwargs):
    from horovod.ray.elastic import RayHostDiscovery

    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    discovery = RayHostDiscovery(**kwargs)
    return discovery, discovery.find_available_hosts_and_slots()


def test_entries_without_node_id_are_hosts_by_address(monkeypatch):
    nodes = [{"NodeManagerAddress": f"10.0.0.{i}", "Resources": {"CPU": 4, "GPU": 2}, "alive": True}
             for i in range(3)]
    nodes.append({"NodeManagerAddress": "10.0.0.9", "Resources": {"CPU": 4}, "alive": False})
    _, mapping = _discover(monkeypatch, nodes, cpus_per_worker=2)
    assert mapping == {"10.0.0.0": 2, "10.0.0.1": 2, "10.0.0.2": 2}
    _, mapping = _discover(monkeypatch, nodes, use_gpu=True, cpus_per_worker=1, gpus_per_worker=2)
    assert mapping == {"10.0.0.0": 1, "10.0.0.1": 1, "10.0.0.2": 1}
    _, mapping = _discover(monkeypatch, nodes, use_gpu=True, cpus_per_worker=1, gpus_per_worker=4)
    assert sum(mapping.values()) == 0  # upstream's "mismatch": no slot anywhere


def test_node_ids_tell_apart_nodes_on_one_address(monkeypatch):
    nodes = [{"NodeManagerAddress": "10.0.0.1", "NodeID": "aaaaaaaa1111", "Resources": {"CPU": 2}, "Alive": True},
             {"NodeManagerAddress": "10.0.0.1", "NodeID": "bbbbbbbb2222", "Resources": {"CPU": 1}, "Alive": True}]
    discovery, mapping = _discover(monkeypatch, nodes)
    assert mapping == {"10.0.0.1-aaaaaaaa": 2, "10.0.0.1-bbbbbbbb": 1}
    assert discovery.node_ids == {"10.0.0.1-aaaaaaaa": "aaaaaaaa1111", "10.0.0.1-bbbbbbbb": "bbbbbbbb2222"}
