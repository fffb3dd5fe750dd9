"""One real local Ray cluster for every Ray test: a head node with 2 CPUs and a second node with
1 CPU (two raylets on this machine), so that ranks are grouped by node and a node can be added
while an elastic job runs. Ray starts slowly (seconds), so the cluster is shared by every test of
this directory and stopped after the last one."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

try:
    import ray
except ImportError:  # the tests skip themselves, with the reason
    ray = None

_STORE = 100 * 1024 * 1024  # a small object store per node: the machine is shared


@dataclass
class RayCluster:
    cluster: Any
    head_id: str
    second_id: str

    def add_node(self, num_cpus: int = 1, **kwargs: Any) -> Any:
        node = self.cluster.add_node(num_cpus=num_cpus, object_store_memory=_STORE, **kwargs)
        self.cluster.wait_for_nodes()
        return node

    def remove_node(self, node: Any) -> None:
        self.cluster.remove_node(node)


_cluster: RayCluster | None = None
_HERE = os.path.dirname(os.path.abspath(__file__))


def _get_cluster() -> RayCluster:
    global _cluster
    if ray is None:
        pytest.skip("Ray is not installed (pip install 'horovod-py[ray]')")
    if _cluster is None:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=2, object_store_memory=_STORE, include_dashboard=False))
        second = cluster.add_node(num_cpus=1, object_store_memory=_STORE)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=True)
        # Test functions travel to the actors by value (the actors cannot import the test modules).
        for name, mod in list(sys.modules.items()):
            if name.startswith(("test_ray", "ray_jobs")):
                ray.cloudpickle.register_pickle_by_value(mod)
        _cluster = RayCluster(cluster, cluster.head_node.node_id, second.node_id)
    return _cluster


def _stop_cluster() -> None:
    global _cluster
    if _cluster is not None:
        cluster, _cluster = _cluster.cluster, None
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    """The shared cluster (started by the first Ray test, stopped after the last one)."""
    yield _get_cluster()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    # After the last test of this directory (and its fixtures' teardown), the cluster goes: the
    # rest of the suite does not share the machine with idle Ray processes.
    if nextitem is None or not str(nextitem.path).startswith(_HERE + os.sep):
        _stop_cluster()


@pytest.fixture
def free_cluster(ray_cluster: RayCluster) -> Iterator[RayCluster]:
    """The shared cluster; after the test, checks that every CPU was given back."""
    yield ray_cluster
    import time

    total = ray.cluster_resources().get("CPU", 0)
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < total and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == total, (
        f"CPUs still held after the test: {ray.available_resources()} of {ray.cluster_resources()}")
