"""The launcher's side of a Gloo job whose ranks a cluster engine starts (Ray actors, Spark tasks).

``horovodrun`` starts its own worker processes; with Ray or Spark the engine owns the processes and
Horovod only has to hand each of them the environment ``horovodrun`` would have given it. A
``FunctionJob`` is that part of the launcher: it runs the authenticated rendezvous service (the
one ``horovodrun --gloo`` runs, ``horovod.runner.rendezvous``) and computes, from the hosts the
engine placed the ranks on, every rank's variables: ``HOROVOD_RANK``/``SIZE``/``LOCAL_RANK``/
``CROSS_RANK``/..., the rendezvous address, port and secret, and the Gloo controller settings
(``plan.build_plan``, the same code path as ``horovodrun``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from horovod.common import protocol
from horovod.runner.hosts import HostSpec, SlotInfo
from horovod.runner.launch.plan import SECRET_ENV, build_plan
from horovod.runner.rendezvous import RendezvousServer, make_secret
from horovod.runner.settings import LaunchSettings

__all__ = ["FunctionJob"]


class FunctionJob:
    """The rendezvous service of one job and the environment of its ranks.

    Args:
        advertised_addr: the address the ranks reach this process at (the driver's node IP).
        bind_addr: the address the service listens on (default: every interface; each request
            is authenticated with the job's secret).
        secret: the job's secret (default: a new random one).

    Use as a context manager, or call ``stop()``.
    """

    def __init__(self, advertised_addr: str, bind_addr: str = "0.0.0.0",
                 secret: str | None = None) -> None:
        self.secret = secret or make_secret()
        self.addr = advertised_addr
        self.server = RendezvousServer(self.secret, host=bind_addr)

    @property
    def port(self) -> int:
        return self.server.port

    def base_env(self) -> dict[str, str]:
        """The variables every rank (and every elastic worker) of this job needs to find it."""
        return {SECRET_ENV: self.secret, protocol.RUNNER_ADDR_ENV: self.addr,
                protocol.RUNNER_PORT_ENV: str(self.port)}

    def worker_envs(self, hosts: Sequence[HostSpec], np: int | None = None, *,
                    nics: Sequence[str] | None = None,
                    extra_env: Mapping[str, str] | None = None,
                    ) -> list[tuple[SlotInfo, dict[str, str]]]:
        """Assign ranks to the hosts' slots in order; return (slot, environment) per rank.

        ``hosts`` lists each host once with the number of ranks it runs, in the order ranks
        should be numbered (ranks on one host are consecutive, so ``local_rank`` and
        ``cross_rank`` come out as under ``horovodrun -H``).

        Raises:
            ConfigError: ``np`` is larger than the slots, or a host is listed twice.
        """
        np = sum(h.slots for h in hosts) if np is None else np
        settings = LaunchSettings(command=["<function>"], np=np, nics=list(nics or []),
                                  extra_env=dict(extra_env or {}))
        plan = build_plan(settings, list(hosts), environ={}, local_hosts=set(), mode="gloo",
                          rendezvous=(self.addr, str(self.port)))
        common = {**plan.job_env, **self.base_env()}
        return [(r.slot, {**common, **r.env}) for r in plan.ranks]

    def elastic_worker_env(self, slot: SlotInfo, *, nics: Sequence[str] | None = None,
                           extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of one elastic worker started on ``slot`` (``horovod.runner.elastic``:
        the worker is known to the driver as ``slot.hostname[slot.local_rank]`` for its life and
        asks the driver for its rank in every round)."""
        settings = LaunchSettings(command=["<function>"], np=1, nics=list(nics or []),
                                  extra_env=dict(extra_env or {}))
        plan = build_plan(settings, [HostSpec(slot.hostname, 1)], environ={}, local_hosts=set(),
                          mode="gloo", rendezvous=(self.addr, str(self.port)))
        return {**plan.job_env, **self.base_env(), **slot.env(),
                **protocol.elastic_env(slot.hostname, slot.local_rank)}

    def set_elastic_handler(self, handler: Any) -> None:
        """Answer the elastic workers' calls (``ElasticDriver.handle``; None: no elastic job)."""
        self.server.set_elastic_handler(handler)

    def put(self, scope: str, key: str, value: bytes) -> None:
        self.server.put(scope, key, value)

    def get(self, scope: str, key: str) -> bytes | None:
        return self.server.get(scope, key)

    def stop(self) -> None:
        self.server.stop()

    def __enter__(self) -> FunctionJob:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
