"""Elastic ``RayExecutor`` jobs (``min_workers``): the elastic driver of ``horovodrun``, with
Ray actors as workers and Ray's nodes as hosts.

* Hosts are Ray's alive nodes, named ``<ip>-<node id prefix>``; a node offers
  ``CPU // cpus_per_worker`` slots (and no more than ``GPU // gpus_per_worker`` with ``use_gpu``),
  as upstream's ``RayHostDiscovery``. Nodes that join the cluster are found within a second.
* Every worker is an actor pinned to its node (``NodeAffinitySchedulingStrategy``), started by the
  driver (``horovod.runner.elastic.driver.ElasticDriver``) when it needs one, and ended when the
  training function returns. An actor that dies counts as a failed worker: its node is
  blacklisted (``cooldown_range``), the survivors restore their last commit and go on.
* ``run`` returns the results of the workers of the final round, in their final rank order.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from horovod.common import exceptions as errors
from horovod.ray.worker import BaseHorovodWorker
from horovod.runner.elastic.discovery import HostManager
from horovod.runner.elastic.driver import ElasticDriver, Key, key_name
from horovod.runner.elastic.launch import configure_logging
from horovod.runner.elastic.settings import DEFAULT_ELASTIC_TIMEOUT
from horovod.runner.elastic.settings import ElasticSettings as SessionSettings
from horovod.runner.hosts import SlotInfo

__all__ = ["RayHostDiscovery", "ElasticAdapter", "ElasticRayExecutor", "ElasticSettings"]

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

    def __init__(self, adapter: ElasticAdapter, driver: ElasticDriver, key: Key, slot: SlotInfo,
                 fn: Any) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.key, self.driver, self.adapter = key, driver, adapter
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
        self.finished = threading.Event()
        self.stopped = False
        threading.Thread(target=self._wait, daemon=True, name=f"hvd-ray-{key_name(key)}").start()

    def _wait(self) -> None:
        import ray
        import ray.exceptions

        code: int | None
        sig: int | None = None
        try:
            out = ray.get(self.ref)
        except ray.exceptions.RayActorError as exc:
            code, sig = None, int(signal.SIGKILL)
            # A worker the driver stopped (its node blacklisted, left out) did not fail.
            self.adapter.record(self.key, ("stopped",) if self.stopped else ("died", exc))
        except Exception as exc:  # noqa: BLE001 - any other Ray failure is this worker's failure
            code = 1
            self.adapter.record(self.key, ("error", exc, str(exc)))
        else:
            self.adapter.record(self.key, out)
            code = 0 if out[0] == "ok" else out[1] if out[0] == "exit" else 1
        self.kill()
        self.finished.set()
        self.driver.worker_exited(self.key, code, sig)

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
        self.outcomes: dict[Key, tuple[Any, ...]] = {}
        self.lock = threading.Lock()
        self.driver: ElasticDriver | None = None
        self.events: list[str] = []  # what the driver of the last run logged

    def start(self, executable_cls: type | None, executable_args: list[Any] | None,
              executable_kwargs: dict[str, Any] | None, extra_env: dict[str, Any]) -> None:
        import ray

        from horovod.runner.function_job import FunctionJob

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

    def record(self, key: Key, outcome: tuple[Any, ...]) -> None:
        with self.lock:
            self.outcomes[key] = outcome

    def run(self, fn: Any, label: str) -> list[Any]:
        ex = self.ex
        self.outcomes = {}
        what = f"RayExecutor.run({label}) [elastic]"
        manager = HostManager(self.discovery, tuple(ex.cooldown_range) if ex.cooldown_range else None)
        procs: list[_ActorWorker] = []

        def start_worker(key: Key, slot: SlotInfo) -> _ActorWorker:
            proc = _ActorWorker(self, driver, key, slot, fn)
            procs.append(proc)
            return proc

        settings = SessionSettings.from_env(os.environ, timeout=float(ex.elastic_timeout),
                                            reset_limit=ex.reset_limit)
        driver = ElasticDriver.from_settings(settings, manager, ex.min_workers, ex.min_workers,
                                             ex.max_workers, start_worker, put_kv=self.job.put)
        self.driver = driver
        self.job.set_elastic_handler(driver.handle)
        configure_logging()
        try:
            result = driver.run()
        finally:
            driver.stop_all()
            for p in procs:
                p.finished.wait(timeout=10.0)
            self.job.set_elastic_handler(None)
            self.events = list(driver.events)
            self.driver = None
        if result.error is not None:
            ranks = {k: w.rank for k, w in driver.workers.items()}
            failed = {k: o for k, o in self.outcomes.items() if o[0] in ("died", "error")}
            cause = result.root_cause(failed)
            root = (cause.key, failed[cause.key]) if cause is not None and cause.key in failed \
                else next(iter(failed.items()), None)
            raise errors.WorkerFailedError(
                self._failure_text(what, result.error, ranks), events=result.events,
                resets=result.resets, rank=ranks.get(root[0]) if root else None,
                host=root[0][0] if root else None,
                exception=root[1][1] if root else None)
        final = sorted(result.final_ranks.items(), key=lambda kv: kv[1])
        values = []
        for key, _rank in final:
            out = self.outcomes.get(key)
            if out is not None and out[0] == "ok":
                values.append(out[1])
        return values

    def _failure_text(self, what: str, error: str, ranks: dict[Key, int | None]) -> str:
        ex = self.ex
        try:
            offered = self.discovery.find_available_hosts_and_slots()
        except Exception:  # noqa: BLE001 - the cluster may be gone
            offered = {}
        lines = [f"{what}: the elastic job failed: {error}",
                 f"  (RayExecutor: min_workers={ex.min_workers}, max_workers={ex.max_workers}, "
                 f"elastic_timeout={ex.elastic_timeout} s, reset_limit={ex.reset_limit}; the Ray "
                 f"cluster offers {sum(offered.values())} slot(s) of {ex.cpus_per_worker} CPU(s): "
                 f"{', '.join(f'{h}:{n}' for h, n in offered.items()) or 'none'})"]
        for key, out in self.outcomes.items():  # in the order they ended
            who = f"worker {key_name(key)}" + (f" (rank {ranks[key]})" if ranks.get(key) is not None else "")
            if out[0] == "died":
                lines.append(f"  {who} died: {str(out[1]).strip().splitlines()[0]}")
            elif out[0] == "error":
                lines.append(f"  {who} raised {type(out[1]).__name__}: {out[1]}\n{out[2]}")
        return "\n".join(lines)

    def run_remote(self, fn: Any) -> list[Any]:
        raise NotImplementedError("RayExecutor.run_remote: an elastic job's workers come and go, so "
                                  "there are no ObjectRefs to return; use run().")

    def execute_single(self, fn: Any) -> Any:
        raise NotImplementedError("RayExecutor.execute_single is not available in elastic mode; use "
                                  "execute() (every worker) instead.")

    def shutdown(self) -> None:
        if self.driver is not None:
            self.driver.stop_all(grace=0)
        if self.job is not None:
            self.job.stop()
            self.job = None


@dataclass
class ElasticSettings:
    """Settings of ``ElasticRayExecutor`` (upstream's ``ElasticSettings`` fields it used)."""

    min_num_proc: int = 1
    max_num_proc: int | None = None
    reset_limit: int | None = None
    elastic_timeout: int = int(DEFAULT_ELASTIC_TIMEOUT)
    timeout_s: int = 30
    ssh_identity_file: str | None = None
    nics: set[str] | None = None
    cooldown_range: tuple[int, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    discovery: Any = None  # used with override_discovery=False

    @property
    def num_proc(self) -> int:
        return self.min_num_proc


class ElasticRayExecutor:
    """Upstream's older elastic Ray API (deprecated there since 0.25): a thin layer over
    ``RayExecutor(settings, min_workers=..., max_workers=...)``, which new code should use.

    ``run(worker_fn)`` calls ``worker_fn()`` (no arguments) on every worker.
    """

    @staticmethod
    def create_settings(min_num_proc: int = 1, max_num_proc: int | None = None,
                        reset_limit: int | None = None, elastic_timeout: int = int(DEFAULT_ELASTIC_TIMEOUT),
                        timeout_s: int = 30, ssh_identity_file: str | None = None,
                        nics: set[str] | None = None, min_np: int | None = None,
                        max_np: int | None = None, **kwargs: Any) -> ElasticSettings:
        """Settings for ``ElasticRayExecutor`` (``min_np``/``max_np`` are deprecated spellings)."""
        if min_np is not None:
            warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning,
                          stacklevel=2)
            min_num_proc = min_np
        if max_np is not None:
            warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning,
                          stacklevel=2)
            max_num_proc = max_num_proc if max_num_proc is not None else max_np
        cooldown = kwargs.pop("cooldown_range", None)
        return ElasticSettings(min_num_proc, max_num_proc, reset_limit, elastic_timeout, timeout_s,
                               ssh_identity_file, nics, cooldown, dict(kwargs))

    def __init__(self, settings: ElasticSettings, use_gpu: bool = False, cpus_per_slot: int = 1,
                 gpus_per_slot: int | None = None, env_vars: dict[str, Any] | None = None,
                 override_discovery: bool = True) -> None:
        from horovod.ray.runner import MiniSettings, RayExecutor

        warnings.warn("ElasticRayExecutor is deprecated (as upstream); use "
                      "RayExecutor(settings, min_workers=..., max_workers=...)", DeprecationWarning,
                      stacklevel=2)
        self.settings = settings
        self.env_vars = dict(env_vars or {})
        self.executor = RayExecutor(
            MiniSettings(timeout_s=settings.timeout_s, nics=settings.nics,
                         ssh_identity_file=settings.ssh_identity_file, discovery=settings.discovery),
            min_workers=settings.min_num_proc, max_workers=settings.max_num_proc,
            reset_limit=settings.reset_limit, cooldown_range=settings.cooldown_range,
            elastic_timeout=settings.elastic_timeout, cpus_per_worker=cpus_per_slot,
            use_gpu=use_gpu, gpus_per_worker=gpus_per_slot, override_discovery=override_discovery)

    def start(self) -> None:
        """Start the rendezvous service (workers start with ``run``)."""
        self.executor.start(extra_env_vars=self.env_vars)

    def run(self, worker_fn: Callable[[], Any],
            callbacks: list[Callable[..., Any]] | None = None) -> list[Any]:
        """``worker_fn()`` on every worker; the final round's results in rank order."""
        return self.executor.run(worker_fn, callbacks=callbacks)
