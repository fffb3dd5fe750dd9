"""Elastic ``RayExecutor`` jobs (``min_workers``): the elastic session of ``horovodrun``
(``horovod.runner.elastic.session``), with Ray actors as workers and Ray's nodes as hosts.

* Hosts are Ray's alive nodes, named ``<ip>-<node id prefix>``; a node offers
  ``CPU // cpus_per_worker`` slots (and no more than ``GPU // gpus_per_worker`` with ``use_gpu``),
  as upstream's ``RayHostDiscovery``. Nodes that join the cluster are found within a second.
* Every worker is an actor pinned to its node (``NodeAffinitySchedulingStrategy``), started by the
  driver (``horovod.runner.elastic.driver.ElasticDriver``) when it needs one, and ended when the
  training function returns. An actor that dies counts as a failed worker: its node is
  blacklisted (``cooldown_range``), the survivors restore their last commit and go on.
* ``run`` returns the results of the workers of the final round, in their final rank order.

Upstream's deprecated ``ElasticRayExecutor`` (``horovod.ray.elastic``) wraps ``RayExecutor``,
which uses this module.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from typing import Any

from horovod.common import exceptions as errors
from horovod.common.protocol import Died, Exited, FailureRecord, Raised, Returned, task_outcome
from horovod.ray.waiting import LOST
from horovod.ray.worker import BaseHorovodWorker
from horovod.runner.elastic.discovery import HostManager
from horovod.runner.elastic.driver import ElasticDriver, Key, key_name
from horovod.runner.elastic.session import ElasticSession
from horovod.runner.elastic.settings import DriverSettings
from horovod.runner.failures import exception_record
from horovod.runner.hosts import SlotInfo
from horovod.runner.launch.elastic import configure_logging

__all__ = ["RayHostDiscovery", "ElasticAdapter"]

log = logging.getLogger("horovod.ray")


class RayHostDiscovery:
    """Ray's alive nodes and the worker slots each offers (upstream's ``RayHostDiscovery``)."""

    def __init__(self, use_gpu: bool = False, cpus_per_worker: float = 1, gpus_per_worker: float = 1, *,
                 cpus_per_slot: float | None = None, gpus_per_slot: float | None = None) -> None:
        # *_per_slot: the names of upstream's horovod.ray.elastic (*_per_worker: of elastic_v2)
        cpus_per_worker = cpus_per_worker if cpus_per_slot is None else cpus_per_slot
        gpus_per_worker = gpus_per_worker if gpus_per_slot is None else gpus_per_slot
        self.use_gpu, self.cpus_per_worker, self.gpus_per_worker = use_gpu, cpus_per_worker, gpus_per_worker
        self.node_ids: dict[str, str] = {}

    @staticmethod
    def host_name(node: dict[str, Any]) -> str:
        """``<ip>-<node id prefix>`` (several raylets may share an address), or the address alone
        for an entry without ``NodeID`` (as upstream names hosts)."""
        node_id = node.get("NodeID")
        return f"{node['NodeManagerAddress']}-{node_id[:8]}" if node_id else str(node["NodeManagerAddress"])

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        import ray

        hosts: dict[str, int] = {}
        for node in ray.nodes():
            if not node.get("Alive", node.get("alive")):
                continue
            res = node.get("Resources", {})
            slots = math.floor(res.get("CPU", 0) / self.cpus_per_worker)
            if self.use_gpu:
                slots = min(slots, math.floor(res.get("GPU", 0) / self.gpus_per_worker))
            if slots > 0:
                name = self.host_name(node)
                if node.get("NodeID"):
                    self.node_ids[name] = node["NodeID"]
                hosts[name] = hosts.get(name, 0) + int(slots)  # entries without ids: one host per address
        return hosts


class _ActorWorker:
    """One elastic worker: an actor running the training function; reports how it ended."""

    def __init__(self, adapter: ElasticAdapter, session: ElasticSession, key: Key, slot: SlotInfo,
                 fn: Any) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.key, self.session = key, session
        ex = adapter.ex
        node_id = adapter.node_of(key[0])
        cls: Any = ray.remote(BaseHorovodWorker)
        self.actor: Any = cls.options(
            num_cpus=ex.cpus_per_worker, num_gpus=ex.gpus_per_worker if ex.use_gpu else 0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        env = adapter.job.elastic_worker_env(slot, nics=sorted(adapter.settings.nics or []),
                                             extra_env=adapter.extra_env)
        env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(adapter.settings.timeout_s)
        self.actor.update_env_vars.remote(env)
        self.actor.start_executable.remote(*adapter.executable)
        self.ref = self.actor.execute_reported.remote(fn)
        self.stopped = False
        threading.Thread(target=self._wait, daemon=True, name=f"hvd-ray-{key_name(key)}").start()

    def _wait(self) -> None:
        import ray
        import ray.exceptions

        code: int | None
        sig: int | None = None
        record: FailureRecord | None = None
        try:
            out = task_outcome(ray.get(self.ref), f"worker {key_name(self.key)}")
        except ray.exceptions.RayActorError as exc:
            code, sig = None, int(signal.SIGKILL)
            if not self.stopped:  # a worker the driver stopped (its node blacklisted) did not fail
                self.session.record_outcome(self.key, Died(exc))
        except Exception as exc:  # noqa: BLE001 - any other Ray failure is this worker's failure
            code, record = 1, exception_record(exc, time.time())
            self.session.record_outcome(self.key, Raised(exc, str(exc)))
        else:
            if isinstance(out, Exited):
                code = out.code  # an elastic worker the job went on without exits 0
            else:
                code = 0 if isinstance(out, Returned) else 1
                self.session.record_outcome(self.key, out)
            if isinstance(out, Raised):
                record = exception_record(out.error, time.time())
        self.kill()
        self.session.worker_exited(self.key, code, sig, record)

    def stop(self, grace: float = 5.0) -> None:
        """Stop the worker (an actor cannot be asked politely: it is killed)."""
        self.stopped = True
        self.kill()

    def kill(self) -> None:
        import ray

        try:
            ray.kill(self.actor)
        except Exception:  # noqa: BLE001 - already gone
            pass


class ElasticAdapter:
    """Rendezvous service and driver of elastic runs."""

    def __init__(self, executor: Any) -> None:
        self.ex = executor
        self.settings = executor.settings
        self.ray_discovery = RayHostDiscovery(executor.use_gpu, executor.cpus_per_worker,
                                              executor.gpus_per_worker)
        custom = getattr(self.settings, "discovery", None)
        if not executor.override_discovery and custom is None:
            raise ValueError("RayExecutor: override_discovery=False needs settings.discovery (an "
                             "object with find_available_hosts_and_slots() -> {host: slots}).")
        # override_discovery=False: the user's discovery names the hosts (node IPs, node ids or
        # this module's '<ip>-<id>' names); Ray's nodes place the workers.
        self.discovery: Any = self.ray_discovery if executor.override_discovery else custom
        self.job: Any = None
        self.extra_env: dict[str, str] = {}
        self.executable: tuple[Any, Any, Any] = (None, None, None)
        self.session: ElasticSession | None = None
        self.events: list[str] = []  # what the driver of the last run logged

    @property
    def driver(self) -> ElasticDriver | None:
        """The driver of the run in progress (None between runs)."""
        return None if self.session is None else self.session.driver

    def start(self, executable_cls: type | None, executable_args: list[Any] | None,
              executable_kwargs: dict[str, Any] | None, extra_env: dict[str, Any]) -> None:
        import ray

        from horovod.runner.launch.cluster_job import FunctionJob

        self.job = FunctionJob(ray.util.get_node_ip_address())
        self.extra_env = {k: str(v) for k, v in extra_env.items()}
        self.executable = (executable_cls, executable_args, executable_kwargs)

    def node_of(self, host: str) -> str:
        """The Ray node id of a discovered host.

        A host is a node's id, IP or name, or (as upstream places workers, with a ``node:<host>``
        resource) any name for which a node holds the resource ``node:<host>``: Ray gives every
        node ``node:<ip>``, and a cluster may add names of its own (``ray start --resources``).

        Raises:
            LaunchError: no alive Ray node has that name, id, IP or ``node:`` resource.
        """
        if host in self.ray_discovery.node_ids:
            return self.ray_discovery.node_ids[host]
        import ray

        alive = [n for n in ray.nodes() if n.get("Alive", n.get("alive"))]
        for key in ("NodeID", "NodeManagerAddress", "NodeName"):
            for node in alive:
                if node.get(key) == host:
                    return str(node["NodeID"])
        for node in alive:
            if f"node:{host}" in (node.get("Resources") or {}):
                return str(node["NodeID"])
        self.ray_discovery.find_available_hosts_and_slots()
        if host in self.ray_discovery.node_ids:
            return self.ray_discovery.node_ids[host]
        raise errors.LaunchError(f"RayExecutor: discovered host {host!r} is no alive Ray node (give "
                                 "node IPs, node ids, '<ip>-<node id prefix>' names, or names a node "
                                 f"holds as a resource 'node:{host}').", host=host)

    def run(self, fn: Any, label: str) -> list[Any]:
        """``fn`` on every worker as one elastic session; the final round's values in rank order.

        Raises:
            WorkerFailedError: the job gave up (``JobOutcome.failure``: why, the root-cause
                worker first, in the words of every launcher, and what the cluster offered).
        """
        ex = self.ex
        manager = HostManager(self.discovery, tuple(ex.cooldown_range) if ex.cooldown_range else None)
        settings = DriverSettings.from_env(os.environ, timeout=float(ex.elastic_timeout),
                                            reset_limit=ex.reset_limit)

        def start_worker(key: Key, slot: SlotInfo) -> _ActorWorker:
            return _ActorWorker(self, session, key, slot, fn)

        # The rendezvous service outlives the run: successive runs use it until shutdown().
        session = ElasticSession(settings, manager, ex.min_workers, ex.min_workers,
                                 ex.max_workers, start_worker, self.job, own_service=False,
                                 caller=f"RayExecutor.run({label}) [elastic]", lost=LOST)
        self.session = session
        configure_logging()
        try:
            outcome = session.run()
        finally:
            self.events = list(session.driver.events)
            self.session = None
        return session.results(outcome, [] if outcome.ok else [self._offered()])

    def _offered(self) -> str:
        """The executor's limits and the slots the cluster offers now (a failed run's note)."""
        ex = self.ex
        try:
            offered = self.discovery.find_available_hosts_and_slots()
        except Exception:  # noqa: BLE001 - the cluster may be gone
            offered = {}
        return (f"  (RayExecutor: min_workers={ex.min_workers}, max_workers={ex.max_workers}, "
                f"elastic_timeout={ex.elastic_timeout} s, reset_limit={ex.reset_limit}; the Ray "
                f"cluster offers {sum(offered.values())} slot(s) of {ex.cpus_per_worker} CPU(s): "
                f"{', '.join(f'{h}:{n}' for h, n in offered.items()) or 'none'})")

    def run_remote(self, fn: Any) -> list[Any]:
        raise NotImplementedError("RayExecutor.run_remote: an elastic job's workers come and go, so "
                                  "there are no ObjectRefs to return; use run().")

    def execute_single(self, fn: Any) -> Any:
        raise NotImplementedError("RayExecutor.execute_single is not available in elastic mode; use "
                                  "execute() (every worker) instead.")

    def shutdown(self) -> None:
        if self.session is not None:
            self.session.driver.stop_all(grace=0)
        if self.job is not None:
            self.job.stop()
            self.job = None
