"""Upstream's module name for the elastic side of ``RayExecutor`` (``min_workers``/``max_workers``):
``RayHostDiscovery`` (Ray's alive nodes and their worker slots) and ``ElasticAdapter``, the same
classes as ``horovod.ray.elastic``'s."""

from horovod.ray.elastic import ElasticAdapter, RayHostDiscovery

__all__ = ["RayHostDiscovery", "ElasticAdapter"]
