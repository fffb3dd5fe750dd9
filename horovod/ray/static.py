"""Static ``RayExecutor`` jobs: a fixed set of rank actors that live until ``shutdown()``; each
``run`` is one call of a ``StaticSession`` (``horovod.runner.launch.static_session``), whose failure is
reported in the text of every launcher."""

from __future__ import annotations

import logging
from typing import Any

from horovod.common import exceptions as errors
from horovod.common.protocol import Died
from horovod.ray.placement import NodeInfo, group_by_node, node_labels, reserve, shared_visible_devices
from horovod.ray.waiting import FAILURE_GRACE_SECONDS, LOST, Failure, call_outcome, wait_all
from horovod.ray.worker import BaseHorovodWorker
from horovod.runner.hosts import HostSpec

__all__ = ["StaticAdapter"]

log = logging.getLogger("horovod.ray")


class StaticAdapter:
    """Workers, placement group and rendezvous service of one static job."""

    def __init__(self, executor: Any) -> None:
        self.ex = executor
        self.settings = executor.settings
        self.workers: list[Any] = []
        self.nodes: list[NodeInfo] = []
        self.labels: dict[str, str] = {}
        self.pg: Any = None
        self.owns_pg = False
        self.job: Any = None
        self.broken: str | None = None

    # ------------------------------------------------------------------ start
    def _placement(self) -> tuple[int, list[dict[str, Any]]]:
        """(number of workers, Ray options per worker); creates the placement group."""
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ex = self.ex
        res: dict[str, float] = {"CPU": float(ex.cpus_per_worker)}
        if ex.use_gpu:
            res["GPU"] = float(ex.gpus_per_worker)
        current = get_current_placement_group() if ex.use_current_placement_group else None
        timeout = float(self.settings.placement_group_timeout_s)
        if current is not None:
            log.info("RayExecutor: placing the workers in the current placement group "
                     "(use_current_placement_group=False to create a new one)")
            self.pg = current
            n = ex.num_workers or (ex.num_hosts or 0) * ex.num_workers_per_host \
                or len(current.bundle_specs)
            index = [-1] * n
        elif ex.num_workers is not None:
            n = ex.num_workers
            self.pg = reserve([dict(res) for _ in range(n)], "PACK", timeout, f"{n} worker(s)")
            self.owns_pg = True
            index = list(range(n))
        else:
            per = ex.num_workers_per_host
            n = ex.num_hosts * per
            bundle = {k: v * per for k, v in res.items()}
            self.pg = reserve([dict(bundle) for _ in range(ex.num_hosts)], "STRICT_SPREAD", timeout,
                              f"{ex.num_hosts} node(s) with {per} worker(s) each")
            self.owns_pg = True
            index = [i // per for i in range(n)]
        opts = [dict(num_cpus=ex.cpus_per_worker, num_gpus=ex.gpus_per_worker if ex.use_gpu else 0,
                     scheduling_strategy=PlacementGroupSchedulingStrategy(
                         self.pg, placement_group_bundle_index=i,
                         placement_group_capture_child_tasks=False)) for i in index]
        return n, opts

    def start(self, executable_cls: type | None, executable_args: list[Any] | None,
              executable_kwargs: dict[str, Any] | None, extra_env: dict[str, Any]) -> None:
        import ray

        from horovod.runner.launch.cluster_job import FunctionJob

        try:
            n, opts = self._placement()
            cls: Any = ray.remote(BaseHorovodWorker)
            actors: list[Any] = [cls.options(**o).remote() for o in opts]
            timeout = float(self.settings.timeout_s)
            refs = [a.node_info.remote() for a in actors]
            ready, _ = ray.wait(refs, num_returns=n, timeout=max(timeout, 60.0))
            if len(ready) < n:
                for a in actors:
                    ray.kill(a)
                raise errors.LaunchError(f"RayExecutor: only {len(ready)} of {n} worker actors "
                                         f"started within {max(timeout, 60.0):g} s.")
            infos = [NodeInfo(*info) for info in ray.get(refs)]
            order = group_by_node(infos)
            self.workers = [actors[i] for i in order]
            self.nodes = [infos[i] for i in order]
            self.labels = node_labels(self.nodes)
            hosts: dict[str, int] = {}
            for info in self.nodes:
                label = self.labels[info.node_id]
                hosts[label] = hosts.get(label, 0) + 1
            self.job = FunctionJob(ray.util.get_node_ip_address())
            envs = self.job.worker_envs([HostSpec(h, c) for h, c in hosts.items()],
                                        nics=sorted(self.settings.nics or []))
            gloo = {"HOROVOD_GLOO_TIMEOUT_SECONDS": str(self.settings.timeout_s)}
            for env in envs:
                env[1].update(gloo)
            if self.ex.use_gpu:
                gpu_ids = ray.get([w.get_gpu_ids.remote() for w in self.workers])
                visible = shared_visible_devices([i.node_id for i in self.nodes], gpu_ids)
                for env, devices in zip(envs, visible):
                    env[1]["CUDA_VISIBLE_DEVICES"] = devices
            ray.get([w.update_env_vars.remote({**env, **extra_env})
                     for w, (_, env) in zip(self.workers, envs)])
            ray.get([w.start_executable.remote(executable_cls, executable_args, executable_kwargs)
                     for w in self.workers])
        except BaseException:
            self.shutdown()
            raise
        log.info("RayExecutor: %d worker(s) on %s", n,
                 ", ".join(f"{h}:{c}" for h, c in hosts.items()))

    # ------------------------------------------------------------------ calls
    def describe(self, rank: int) -> str:
        info = self.nodes[rank]
        return f"rank {rank} (node {self.labels[info.node_id]}, node id {info.node_id[:12]}, pid {info.pid})"

    def _check(self) -> None:
        if self.broken is not None:
            raise errors.LaunchError(f"RayExecutor: the workers were stopped after a failure ({self.broken}); "
                                     "call start() again.")

    def run(self, fn: Any, label: str) -> list[Any]:
        """``fn(executable)`` on every rank, one call of the job's ``StaticSession``; the values
        in rank order.

        Raises:
            WorkerFailedError: a rank raised, its actor died, or it did not finish within
                ``FAILURE_GRACE_SECONDS`` of a failure (every worker is stopped then).
        """
        from horovod.runner.launch.static_session import StaticSession

        self._check()
        what = f"RayExecutor.run({label})"
        # The actors outlive the call: the session owns no service and starts nothing.
        session = StaticSession(len(self.workers), what, where=self.describe, own_service=False,
                                lost=LOST, stuck_wait=FAILURE_GRACE_SECONDS, upstream=False)
        outcome = session.run(lambda: call_outcome(*self._call(fn, what)))
        if outcome.ok:
            return outcome.values()
        died = [r for r, o in outcome.outcomes.items() if isinstance(o, Died)]
        notes: list[str] = []
        if died or outcome.stuck:
            self.broken = f"rank(s) {sorted(died + outcome.stuck)} died or hung"
            notes.append("The job cannot go on without those ranks: every worker was stopped; call "
                         "start() again to run more (or use min_workers for an elastic job).")
            self._stop_workers()
        return session.results(outcome, notes)

    def _call(self, fn: Any, what: str) -> tuple[list[Any], dict[int, Failure], list[int],
                                                 dict[int, float]]:
        """Start ``fn`` on every worker; wait for them (``wait_all``)."""
        refs = [w.execute_reported.remote(fn) for w in self.workers]
        times: dict[int, float] = {}
        values, failures, stuck = wait_all(refs, self.describe, what, times=times)
        return values, failures, stuck, times

    def run_remote(self, fn: Any) -> list[Any]:
        self._check()
        return [w.execute.remote(fn) for w in self.workers]

    def execute_single(self, fn: Any) -> Any:
        import ray

        self._check()
        return ray.get(self.workers[0].execute.remote(fn))

    # ------------------------------------------------------------------ stop
    def _stop_workers(self) -> None:
        import ray

        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.workers and self.broken is None:
            # Every rank leaves Horovod together first: no rank sees a peer vanish.
            ray.wait([w.shutdown_horovod.remote() for w in self.workers], num_returns=len(self.workers),
                     timeout=10.0)
        self._stop_workers()
        self.workers = []
        if self.pg is not None and self.owns_pg:
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - cluster already gone
                pass
        self.pg = None
        if self.job is not None:
            self.job.stop()
            self.job = None
