"""Upstream's deprecated elastic Ray API: ``ElasticRayExecutor`` and its ``ElasticSettings``, a
thin layer over ``RayExecutor(settings, min_workers=..., max_workers=...)``.

Elastic jobs themselves (discovery of Ray's nodes, actors as workers, the elastic session) are in
``horovod.ray.elastic_v2``; ``RayHostDiscovery`` and ``ElasticAdapter`` are importable from here
as upstream's code expects.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from horovod.ray.elastic_v2 import ElasticAdapter, RayHostDiscovery
from horovod.ray.runner import MiniSettings, RayExecutor
from horovod.runner.elastic.settings import DEFAULT_ELASTIC_TIMEOUT

__all__ = ["RayHostDiscovery", "ElasticAdapter", "ElasticRayExecutor", "ElasticSettings"]

# The other settings upstream's create_settings passed on to its ElasticSettings (BaseSettings):
# accepted for its callers, without effect here.
_UPSTREAM_SETTINGS = frozenset({"verbose", "ssh_port", "extra_mpi_args", "tcp_flag", "binding_args", "key",
                                "start_timeout", "output_filename", "run_func", "prefix_output_with_timestamp"})


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
        """Settings for ``ElasticRayExecutor`` (``min_np``/``max_np`` are deprecated spellings).

        ``cooldown_range`` and ``discovery`` (for ``override_discovery=False``) are taken from
        ``kwargs``; the other settings upstream's accepted there
        (``verbose``, ``key``, ``start_timeout``...) have no effect (Ray starts the workers).

        Raises:
            TypeError: a keyword upstream's ``create_settings`` did not take either.
        """
        if min_np is not None:
            warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning,
                          stacklevel=2)
            min_num_proc = min_np
        if max_np is not None:
            warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning,
                          stacklevel=2)
            max_num_proc = max_num_proc if max_num_proc is not None else max_np
        cooldown = kwargs.pop("cooldown_range", None)
        discovery = kwargs.pop("discovery", None)
        unknown = sorted(set(kwargs) - _UPSTREAM_SETTINGS)
        if unknown:
            raise TypeError(f"ElasticRayExecutor.create_settings() got unexpected keyword arguments "
                            f"{unknown}; it takes those of upstream's ElasticSettings: "
                            f"{sorted(_UPSTREAM_SETTINGS | {'cooldown_range', 'discovery'})}")
        return ElasticSettings(min_num_proc, max_num_proc, reset_limit, elastic_timeout, timeout_s,
                               ssh_identity_file, nics, cooldown, discovery)

    def __init__(self, settings: ElasticSettings, use_gpu: bool = False, cpus_per_slot: int = 1,
                 gpus_per_slot: int | None = None, env_vars: dict[str, Any] | None = None,
                 override_discovery: bool = True) -> None:
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
