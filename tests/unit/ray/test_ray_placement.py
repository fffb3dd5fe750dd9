"""Pure pieces of ``horovod.ray``: rank numbering by node, node names, Ray host discovery."""

from __future__ import annotations

import pytest

from horovod.ray.placement import NodeInfo, group_by_node, node_labels, shared_visible_devices
from horovod.runner.hosts import HostSpec
from horovod.runner.launch.cluster_job import FunctionJob


def _info(node: str, ip: str = "10.0.0.1", pid: int = 1) -> NodeInfo:
    return NodeInfo(node_id=node, ip=ip, hostname="h", pid=pid)


def test_ranks_are_grouped_by_node_in_order_of_first_appearance():
    infos = [_info("b"), _info("a"), _info("b"), _info("c"), _info("a")]
    assert group_by_node(infos) == [0, 2, 1, 4, 3]


def test_node_labels_use_the_ip_and_add_the_id_only_where_ips_repeat():
    infos = [_info("aaaaaaaaaaaa", "10.0.0.1"), _info("bbbbbbbbbbbb", "10.0.0.1"),
             _info("cccccccccccc", "10.0.0.2")]
    assert node_labels(infos) == {"aaaaaaaaaaaa": "10.0.0.1-aaaaaaaa",
                                  "bbbbbbbbbbbb": "10.0.0.1-bbbbbbbb", "cccccccccccc": "10.0.0.2"}


def test_function_job_envs_give_local_and_cross_ranks_per_node():
    with FunctionJob("10.0.0.9") as job:
        envs = job.worker_envs([HostSpec("n1", 2), HostSpec("n2", 1)])
        elastic = job.elastic_worker_env(envs[2][0])
    got = [(e["HOROVOD_RANK"], e["HOROVOD_LOCAL_RANK"], e["HOROVOD_LOCAL_SIZE"], e["HOROVOD_CROSS_RANK"],
            e["HOROVOD_CROSS_SIZE"], e["HOROVOD_HOSTNAME"]) for _, e in envs]
    assert got == [("0", "0", "2", "0", "2", "n1"), ("1", "1", "2", "0", "1", "n1"),
                   ("2", "0", "1", "1", "2", "n2")]
    for _, e in envs:
        assert e["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "10.0.0.9" == e["HOROVOD_RUNNER_ADDR"]
        assert e["HOROVOD_CONTROLLER"] == "gloo" and e["HOROVOD_SECRET_KEY"] == job.secret
    assert elastic["HOROVOD_ELASTIC"] == "1" and elastic["HOROVOD_ELASTIC_HOST"] == "n2"
    assert elastic["HOROVOD_ELASTIC_SLOT"] == "0" and elastic["HOROVOD_SECRET_KEY"] == job.secret


def test_ray_host_discovery_counts_slots_per_alive_node(monkeypatch):
    ray = pytest.importorskip("ray", reason="Ray is not installed")
    from horovod.ray.elastic import RayHostDiscovery

    nodes = [
        {"NodeID": "a" * 40, "NodeManagerAddress": "10.0.0.1", "Alive": True,
         "Resources": {"CPU": 8.0, "GPU": 2.0}},
        {"NodeID": "b" * 40, "NodeManagerAddress": "10.0.0.2", "Alive": False,
         "Resources": {"CPU": 8.0}},
        {"NodeID": "c" * 40, "NodeManagerAddress": "10.0.0.3", "Alive": True,
         "Resources": {"CPU": 1.0}},
    ]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    assert RayHostDiscovery(cpus_per_worker=2).find_available_hosts_and_slots() == {
        "10.0.0.1-aaaaaaaa": 4}
    gpu = RayHostDiscovery(use_gpu=True, cpus_per_worker=1, gpus_per_worker=1)
    assert gpu.find_available_hosts_and_slots() == {"10.0.0.1-aaaaaaaa": 2}
    assert gpu.node_ids == {"10.0.0.1-aaaaaaaa": "a" * 40}
    # upstream's horovod.ray.elastic names the same per slot
    assert RayHostDiscovery(cpus_per_slot=2).find_available_hosts_and_slots() == {"10.0.0.1-aaaaaaaa": 4}
    assert RayHostDiscovery(True, cpus_per_slot=1, gpus_per_slot=2).find_available_hosts_and_slots() == {
        "10.0.0.1-aaaaaaaa": 1}


def test_every_rank_of_a_node_sees_the_gpus_of_its_node_in_rank_order():
    assert shared_visible_devices(["a", "a", "b", "b"], [[3], [1], [0], [2]]) == \
        ["3,1", "3,1", "0,2", "0,2"]
    assert shared_visible_devices(["a"], [[]]) == [""]


def test_upstream_elastic_v2_module_names_the_same_discovery():
    pytest.importorskip("ray")
    from horovod.ray import elastic, elastic_v2

    assert elastic_v2.RayHostDiscovery is elastic.RayHostDiscovery
    assert elastic_v2.ElasticAdapter is elastic.ElasticAdapter
