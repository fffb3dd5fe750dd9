"""``RayExecutor`` under Ray Client (``ray.init("ray://<head>:10001")``), as upstream runs it.

A Ray Client process is outside the cluster: the workers could not reach a rendezvous service
it ran. So, as upstream's executor does, the driver side of the job (placement group, actors,
the Gloo rendezvous service, the elastic driver) runs in one actor on the cluster
(``num_cpus=0``), a ``RayExecutor`` there, and the client's executor forwards every call to it.
Callbacks stay on the client: the workers' ``ray_logger`` values travel through a Ray queue that
the client reads.
"""

from __future__ import annotations

from typing import Any

__all__ = ["client_connected", "start_remote"]


def client_connected() -> bool:
    """Whether this process talks to Ray through Ray Client."""
    try:
        from ray.util.client import ray as client

        return bool(client.is_connected())
    except Exception:  # noqa: BLE001 - no client support in this Ray: not connected through it
        return False


def start_remote(actor_cls: type, settings: Any, kwargs: dict[str, Any], start_args: tuple[Any, ...]) -> Any:
    """Create the actor (``actor_cls(settings, kwargs)``, holding a ``RayExecutor``) and start the
    job's workers from it; returns the actor handle."""
    import ray

    actor: Any = ray.remote(num_cpus=0)(actor_cls).remote(settings, kwargs)
    try:
        ray.get(actor.start.remote(*start_args))
    except BaseException:
        ray.kill(actor)
        raise
    return actor
