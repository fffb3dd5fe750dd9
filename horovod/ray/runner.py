"""``RayExecutor``: Horovod jobs whose ranks are Ray actors (upstream's ``horovod.ray``).

Static mode (``num_workers`` or ``num_hosts``): ``start()`` reserves the workers' resources in a
placement group, starts one actor per rank, numbers the ranks node by node and hands every actor
the environment ``horovodrun --gloo`` gives a worker; the Gloo rendezvous service runs in the
driver (``horovod.runner.launch.cluster_job``). The actors stay up until ``shutdown()``, so
successive ``run`` calls reuse them. Elastic mode (``min_workers``): see ``horovod.ray.elastic_v2``.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from horovod.common import exceptions as errors
from horovod.common.protocol import FunctionCall
from horovod.ray.client import client_connected, start_remote

__all__ = ["RayExecutor", "MiniSettings"]

log = logging.getLogger("horovod.ray")


@dataclass
class MiniSettings:
    """The settings ``RayExecutor`` uses (upstream's ``MiniSettings``)."""

    nics: set[str] | None = None
    verbose: int = 1
    key: str | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    timeout_s: int = 30
    placement_group_timeout_s: int = 100
    elastic: bool = False
    # Elastic mode with override_discovery=False: find_available_hosts_and_slots() -> {host: slots}
    discovery: Any = None
    # The job's live view on the driver (horovodrun --monitor-port; docs/monitor.md): None is off.
    monitor_port: int | None = None
    monitor_address: str | None = None


def _label(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


class RayExecutor:
    """Run Horovod ranks as Ray actors.

    Args:
        settings: from ``RayExecutor.create_settings``.
        num_workers: number of ranks (static mode).
        num_hosts / num_workers_per_host: instead of ``num_workers``: this many nodes with this
            many ranks each (one placement-group bundle per node, ``STRICT_SPREAD``).
        cpus_per_worker / use_gpu / gpus_per_worker: resources of each rank's actor.
        use_current_placement_group: inside a placement group (a Ray Tune trial), place the
            ranks in it instead of creating one.
        min_workers / max_workers: elastic mode (``horovod.ray.elastic_v2``): go on with at least
            ``min_workers`` ranks, use at most ``max_workers`` (default: every slot found).
        reset_limit / cooldown_range / elastic_timeout: as ``horovodrun``'s ``--reset-limit``,
            ``--blacklist-cooldown-range`` and ``--elastic-timeout``.
        override_discovery: elastic mode: find slots from Ray's nodes (CPUs, GPUs per worker);
            False: use ``settings.discovery`` (hosts named by node IP, node id or
            ``<ip>-<node id prefix>``).

    Raises:
        ValueError: conflicting arguments (the message says which).
    """

    @classmethod
    def create_settings(cls, timeout_s: int = 30, ssh_identity_file: str | None = None,
                        ssh_str: str | None = None, placement_group_timeout_s: int = 100,
                        nics: set[str] | None = None, monitor_port: int | None = None,
                        monitor_address: str | None = None) -> MiniSettings:
        """Settings for ``RayExecutor``.

        Args:
            timeout_s: Gloo rendezvous (and collective) timeout in seconds.
            ssh_identity_file / ssh_str: accepted as upstream (``ssh_str`` is written to
                ``ssh_identity_file`` with mode 0600); Ray starts the workers, so no ssh is used.
            placement_group_timeout_s: how long ``start()`` waits for the resources.
            nics: network interfaces for Gloo (the first one is used).
            monitor_port / monitor_address: serve the job's live view, Prometheus metrics and
                JSON from the driver between ``start()`` and ``shutdown()``
                (``horovodrun --monitor-port``; docs/monitor.md); port 0 picks a free port, and
                ``start()`` prints the URL. The ranks report over the job's rendezvous service.
        """
        if ssh_str and ssh_identity_file and not os.path.exists(ssh_identity_file):
            fd = os.open(ssh_identity_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(ssh_str)
        return MiniSettings(ssh_identity_file=ssh_identity_file, timeout_s=timeout_s,
                            placement_group_timeout_s=placement_group_timeout_s, nics=nics,
                            monitor_port=monitor_port, monitor_address=monitor_address)

    def __init__(self, settings: MiniSettings, num_workers: int | None = None,
                 num_hosts: int | None = None, num_workers_per_host: int | None = 1,
                 cpus_per_worker: int = 1, use_gpu: bool = False,
                 gpus_per_worker: int | None = None, use_current_placement_group: bool = True,
                 min_workers: int | None = None, max_workers: int | None = None,
                 reset_limit: int | None = None, cooldown_range: tuple[int, int] | None = None,
                 elastic_timeout: int = 1200, override_discovery: bool = True) -> None:
        if max_workers and (not min_workers or min_workers <= 0):
            raise ValueError("RayExecutor: max_workers was given without a positive min_workers; "
                             "elastic jobs need min_workers >= 1.")
        if min_workers and num_workers:
            raise ValueError("RayExecutor: Both `min_workers` and `num_workers` provided. Give either "
                             "num_workers (a static job) or min_workers (an elastic job), not both.")
        if gpus_per_worker and not use_gpu:
            raise ValueError("RayExecutor: gpus_per_worker is set but use_gpu is False; set "
                             "use_gpu=True.")
        if use_gpu and gpus_per_worker is not None and gpus_per_worker < 1:
            raise ValueError(f"RayExecutor: gpus_per_worker must be >= 1, got {gpus_per_worker}.")
        if cpus_per_worker <= 0:
            raise ValueError(f"RayExecutor: cpus_per_worker must be > 0, got {cpus_per_worker}.")
        if num_workers_per_host is None:  # upstream accepts an explicit None: one worker per host
            num_workers_per_host = 1
        if min_workers is None:
            if num_workers is None and num_hosts is None:
                raise ValueError("RayExecutor: give num_workers (or num_hosts and "
                                 "num_workers_per_host), or min_workers for an elastic job.")
            if num_workers is not None and num_hosts is not None:
                raise ValueError("RayExecutor: give either num_workers or num_hosts, not both.")
            if (num_workers is not None and num_workers < 1) or (num_hosts is not None and num_hosts < 1) \
                    or num_workers_per_host < 1:
                raise ValueError(f"RayExecutor: num_workers={num_workers}, num_hosts={num_hosts}, "
                                 f"num_workers_per_host={num_workers_per_host}: each must be >= 1.")
        else:
            if min_workers < 1:
                raise ValueError(f"RayExecutor: min_workers must be >= 1, got {min_workers}.")
            if max_workers is not None and max_workers < min_workers:
                raise ValueError(f"RayExecutor: max_workers ({max_workers}) is less than "
                                 f"min_workers ({min_workers}).")
        self.settings = settings
        self.settings.elastic = min_workers is not None
        self.num_workers = num_workers
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = gpus_per_worker or 1
        self.use_current_placement_group = use_current_placement_group
        self.min_workers, self.max_workers = min_workers, max_workers
        self.reset_limit, self.cooldown_range = reset_limit, cooldown_range
        self.elastic_timeout, self.override_discovery = elastic_timeout, override_discovery
        self.adapter: Any = None
        self.monitor: Any = None  # horovod.runner.monitor.MonitorService, with settings.monitor_port
        self._remote: Any = None  # under Ray Client: the actor running this job's driver side
        self._kwargs = dict(num_workers=num_workers, num_hosts=num_hosts,
                            num_workers_per_host=num_workers_per_host, cpus_per_worker=cpus_per_worker,
                            use_gpu=use_gpu, gpus_per_worker=gpus_per_worker,
                            use_current_placement_group=use_current_placement_group,
                            min_workers=min_workers, max_workers=max_workers, reset_limit=reset_limit,
                            cooldown_range=cooldown_range, elastic_timeout=elastic_timeout,
                            override_discovery=override_discovery)

    # ------------------------------------------------------------------ public API
    def start(self, executable_cls: type | None = None, executable_args: list[Any] | None = None,
              executable_kwargs: dict[str, Any] | None = None,
              extra_env_vars: dict[str, Any] | None = None) -> None:
        """Start the workers (static) or the elastic driver's services (elastic).

        Args:
            executable_cls: a class made in every worker (``execute`` passes it to ``fn``).
            executable_args / executable_kwargs: its arguments.
            extra_env_vars: variables set in every worker before anything runs.

        Raises:
            TimeoutError: (``horovod.ray.placement.PlacementTimeoutError``, also a ``LaunchError``)
                the resources could not be reserved within ``placement_group_timeout_s``.
            LaunchError: the workers did not start within ``timeout_s``.
        """
        import ray

        if self.adapter is not None or self._remote is not None:
            self.shutdown()
        if client_connected():
            # Ray Client: the job's driver side runs in an actor on the cluster (horovod.ray.client).
            self._remote = start_remote(_RemoteExecutor, self.settings, self._kwargs,
                                        (executable_cls, executable_args, executable_kwargs, extra_env_vars))
            return
        if not ray.is_initialized():
            ray.init()
        if self.settings.elastic:
            from horovod.ray.elastic_v2 import ElasticAdapter

            adapter: Any = ElasticAdapter(self)
        else:
            from horovod.ray.static import StaticAdapter

            adapter = StaticAdapter(self)
        self._open_monitor()  # before any worker starts: a port in use fails here
        try:
            adapter.start(executable_cls, executable_args, executable_kwargs, extra_env_vars or {})
            self.adapter = adapter
            self._attach_monitor()
        except BaseException:
            self._close_monitor()
            raise

    def run(self, fn: Callable[..., Any], args: list[Any] | tuple[Any, ...] | None = None,
            kwargs: dict[str, Any] | None = None, callbacks: list[Callable[..., Any]] | None = None,
            ) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order.

        ``callbacks``: called on the driver with every value rank 0 logs with
        ``horovod.ray.ray_logger.log(...)`` while ``fn`` runs.

        Raises:
            WorkerFailedError: a rank raised (the error names it, its node, and carries its
                traceback; ``.exception`` is the original) or its actor died.
        """
        return self._call(FunctionCall.of(fn, args, kwargs).on_executable, _label(fn), callbacks)

    def execute(self, fn: Callable[[Any], Any], callbacks: list[Callable[..., Any]] | None = None,
                ) -> list[Any]:
        """``fn(executable)`` on every rank (the object made by ``start(executable_cls)``); the
        results in rank order. ``callbacks`` as in ``run``."""
        return self._call(fn, _label(fn), callbacks)

    def run_remote(self, fn: Callable[..., Any], args: list[Any] | tuple[Any, ...] | None = None,
                   kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Start ``fn(*args, **kwargs)`` on every rank; return the Ray ``ObjectRef`` s, rank order.

        Raises:
            NotImplementedError: in elastic mode (its workers come and go).
        """
        call = FunctionCall.of(fn, args, kwargs).on_executable
        if self._remote is not None:
            import ray

            return ray.get(self._remote.run_remote.remote(call))
        return self._adapter().run_remote(call)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only.

        Raises:
            NotImplementedError: in elastic mode.
        """
        if self._remote is not None:
            import ray

            return ray.get(self._remote.execute_single.remote(fn))
        return self._adapter().execute_single(fn)

    def shutdown(self) -> None:
        """Stop the workers and release their resources, the rendezvous service and the monitor."""
        adapter, self.adapter = self.adapter, None
        try:
            if adapter is not None:
                adapter.shutdown()
        finally:
            self._close_monitor()
        remote, self._remote = self._remote, None
        if remote is not None:
            import ray

            try:
                ray.get(remote.shutdown.remote())
            finally:
                ray.kill(remote)

    # ------------------------------------------------------------------ internals
    def _call(self, fn: Callable[[Any], Any], label: str,
              callbacks: list[Callable[..., Any]] | None) -> list[Any]:
        if self._remote is not None:
            import ray

            def run(f: Callable[[Any], Any]) -> list[Any]:
                return ray.get(self._remote.call.remote(f, label))
        else:
            run = functools.partial(self._run_adapter, label=label)
        if not callbacks:
            return run(fn)
        from horovod.ray.ray_logger import CallbackPump

        with CallbackPump(callbacks) as pump:  # on this side, under Ray Client too
            return run(pump.wrap(fn))

    def _run_adapter(self, fn: Callable[[Any], Any], label: str) -> list[Any]:
        from horovod.runner.job_outcome import JobFailedError

        try:
            return list(self._adapter().run(fn, label))
        except JobFailedError as exc:
            if self.monitor is not None:  # the page shows the failure and its culprit
                from horovod.runner.monitor.cluster import job_failed

                job_failed(self.monitor, exc.outcome, str(exc))
            raise

    # ------------------------------------------------------------------ the monitor
    def _open_monitor(self) -> None:
        from horovod.runner.monitor.cluster import open_monitor
        from horovod.runner.rendezvous import make_secret

        # Reports come over the job's rendezvous service (attach); nothing posts to the
        # service's own port, whose secret is therefore one nobody holds.
        self.monitor = open_monitor(getattr(self.settings, "monitor_port", None),
                                    getattr(self.settings, "monitor_address", None), make_secret(),
                                    self.num_workers or (self.num_hosts or 0) * self.num_workers_per_host,
                                    "RayExecutor")

    def _attach_monitor(self) -> None:
        """Point every rank's reports at the monitor, over the job's rendezvous service."""
        if self.monitor is None:
            return
        import ray

        from horovod.runner.monitor.cluster import attach

        adapter = self.adapter
        if self.settings.elastic:  # workers start with each run, with the adapter's extra env
            adapter.extra_env.update(attach(self.monitor, adapter.job, lambda: adapter.driver))
        else:  # the actors read their environment at hvd.init(), in run()
            env = attach(self.monitor, adapter.job)
            self.monitor.state.world_size = len(adapter.workers)
            ray.get([w.update_env_vars.remote(env) for w in adapter.workers])

    def _close_monitor(self) -> None:
        monitor, self.monitor = self.monitor, None
        if monitor is not None:
            from horovod.runner.monitor.cluster import close

            close(monitor)

    def _adapter(self) -> Any:
        if self.adapter is None:
            raise errors.LaunchError("RayExecutor: call start() before run/execute (or start() again "
                                     "after shutdown()).")
        return self.adapter

    def __del__(self) -> None:  # the placement group must not outlive an executor left behind
        try:
            import sys

            ray = sys.modules.get("ray")
            if (self.adapter is not None or self._remote is not None) and ray is not None \
                    and ray.is_initialized():
                self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


class _RemoteExecutor:
    """Under Ray Client: the actor holding the cluster-side ``RayExecutor`` of a job."""

    def __init__(self, settings: MiniSettings, kwargs: dict[str, Any]) -> None:
        self.executor = RayExecutor(settings, **kwargs)

    def start(self, *args: Any) -> None:
        self.executor.start(*args)

    def call(self, fn: Callable[[Any], Any], label: str) -> list[Any]:
        return self.executor._run_adapter(fn, label)

    def run_remote(self, fn: Callable[[Any], Any]) -> list[Any]:
        return self.executor._adapter().run_remote(fn)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        return self.executor._adapter().execute_single(fn)

    def shutdown(self) -> None:
        self.executor.shutdown()
