"""Horovod on Ray: ranks as Ray actors, started from a driver program or a notebook.

``RayExecutor`` (upstream's ``horovod.ray.RayExecutor``): static jobs with ``num_workers`` (or
``num_hosts`` x ``num_workers_per_host``), elastic jobs with ``min_workers``/``max_workers``.
Needs the ``ray`` extra (``pip install "horovod-py[ray]"``). See docs/ray.md.
"""

from horovod.ray.runner import MiniSettings, RayExecutor
from horovod.ray.worker import BaseHorovodWorker

__all__ = ["RayExecutor", "MiniSettings", "BaseHorovodWorker", "ElasticRayExecutor"]


def __getattr__(name: str) -> object:
    # Upstream's deprecated elastic class; loaded on use (it imports the elastic driver).
    if name == "ElasticRayExecutor":
        from horovod.ray.elastic import ElasticRayExecutor

        return ElasticRayExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
