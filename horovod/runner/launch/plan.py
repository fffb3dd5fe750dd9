"""Build a launch plan: per rank the host, the command and the environment (pure).

``build_plan`` takes everything it needs as arguments (settings, hosts, the launcher's
environment, which hosts are this machine, the rendezvous address) and starts nothing, so
``--dry-run`` and unit tests see exactly what a real launch would do.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field

from horovod.common import exceptions as errors
from horovod.common import protocol
from horovod.runner.hosts import HostSpec, SlotInfo, assign_slots, used_hosts
from horovod.runner.settings import LaunchSettings

__all__ = ["RankPlan", "LaunchPlan", "build_plan", "exportable_env", "format_plan", "SECRET_ENV"]

SECRET_ENV = protocol.SECRET_ENV

# Variables never forwarded to workers: shell internals, per-host identity, the job secret, and
# an enclosing MPI job's variables (a horovodrun started inside mpirun must not leak them).
_NOT_EXPORTED = ("BASH_FUNC_*", "OLDPWD", "PWD", "SHLVL", "_", "HOSTNAME", "SSH_*", "DISPLAY",
                 "*CUDA_VISIBLE_DEVICES", SECRET_ENV, "OMPI_COMM_WORLD_*", "OMPI_MCA_ess_*",
                 "PMIX_*", "PMI_*", "PRTE_*", "MPI_LOCALNRANKS", "MPI_LOCALRANKID")


def exportable_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The launcher's variables that are forwarded to every worker."""
    return {k: v for k, v in environ.items()
            if not any(fnmatch.fnmatchcase(k, pat) for pat in _NOT_EXPORTED)}


@dataclass(frozen=True)
class RankPlan:
    """One rank: where it runs, what it runs, and the variables the launcher sets for it."""

    slot: SlotInfo
    local: bool
    argv: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class LaunchPlan:
    """A whole job. ``job_env`` is set in every worker; ``ranks[i].env`` adds rank i's own."""

    mode: str
    np: int
    hosts: list[HostSpec]
    command: list[str]
    job_env: dict[str, str]
    forward_env: dict[str, str]
    ranks: list[RankPlan] = field(default_factory=list)

    @property
    def remote_hosts(self) -> list[str]:
        seen: dict[str, None] = {}
        for r in self.ranks:
            if not r.local:
                seen.setdefault(r.slot.hostname, None)
        return list(seen)

    @property
    def all_local(self) -> bool:
        return all(r.local for r in self.ranks)


def build_plan(settings: LaunchSettings, hosts: list[HostSpec], environ: Mapping[str, str],
               local_hosts: set[str], mode: str, rendezvous: tuple[str, str] | None = None,
               ) -> LaunchPlan:
    """Assign ranks to slots and compute each rank's environment.

    Args:
        settings: the launch settings (``np``, tunables, ``-x``, interfaces).
        hosts: the hosts in order, from ``-H``/``--hostfile`` (or ``localhost:<np>``).
        environ: the launcher's environment (forwarded to workers, minus ``_NOT_EXPORTED``).
        local_hosts: the names in ``hosts`` that are this machine.
        mode: ``"mpi"`` or ``"gloo"``.
        rendezvous: Gloo only: the (address, port) the workers reach the launcher's service at.

    Raises:
        ConfigError: no command, ``-np`` missing or larger than the slots, a ``-x NAME`` that is
            not set in the launcher's environment.
    """
    if not settings.command:
        raise errors.ConfigError("No command to run. Usage: horovodrun -np 2 python train.py")
    if settings.np is None:
        raise errors.ConfigError("-np is required: give the total number of processes, e.g. -np 4.")
    slots = assign_slots(hosts, settings.np)

    job_env: dict[str, str] = {"PYTHONUNBUFFERED": "1"}
    if "THP_MEM_ALLOC_ENABLE" not in environ:
        # PyTorch then asks for transparent huge pages for CPU blocks of 2 MiB or more (read when
        # torch loads): the engine reduces large tensors in place instead of copying them through
        # its own huge-page buffer (horovod/common/engine/pages.py). Set it to 0 to keep torch's
        # default.
        job_env["THP_MEM_ALLOC_ENABLE"] = "1"
    for name, value in settings.extra_env.items():
        if value is None:
            if name not in environ:
                raise errors.ConfigError(f"-x {name}: {name} is not set in horovodrun's environment; "
                                  f"use -x {name}=VALUE to set it.", variable=name)
            value = environ[name]
        job_env[name] = value
    job_env.update(settings.tunable_env)
    if settings.nics:
        job_env["NCCL_SOCKET_IFNAME"] = ",".join(settings.nics)

    if mode == "gloo":
        if rendezvous is None:
            raise errors.ConfigError("Gloo mode needs the rendezvous address of the launcher.")
        job_env.update({
            protocol.RENDEZVOUS_ADDR_ENV: rendezvous[0],
            protocol.RENDEZVOUS_PORT_ENV: str(rendezvous[1]),
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
        })
        if settings.nics and "/" not in settings.nics[0]:
            # An interface name; a CIDR range (which mpirun accepts) is no interface for Gloo.
            job_env["HOROVOD_GLOO_IFACE"] = settings.nics[0]
    elif mode != "mpi":
        raise errors.ConfigError(f"Unknown launch mode {mode!r}; expected 'mpi' or 'gloo'.")

    ranks = []
    for slot in slots:
        env = slot.env() if mode == "gloo" else {}
        ranks.append(RankPlan(slot=slot, local=slot.hostname in local_hosts,
                              argv=list(settings.command), env=env))
    return LaunchPlan(mode=mode, np=settings.np, hosts=used_hosts(hosts, settings.np),
                      command=list(settings.command), job_env=job_env,
                      forward_env=exportable_env(environ), ranks=ranks)


def format_plan(plan: LaunchPlan, commands_text: list[str] | None = None) -> str:
    """Render the plan for ``--dry-run``: per rank the host, command and launcher-set variables."""
    import shlex

    lines = [f"Launch plan: {plan.np} processes on {len(plan.hosts)} host(s) "
             f"({','.join(str(h) for h in plan.hosts)}), mode {plan.mode}",
             f"Environment for every rank ({len(plan.forward_env)} variables forwarded from "
             "horovodrun's environment, plus):"]
    lines += [f"  {k}={v}" for k, v in sorted(plan.job_env.items())]
    for r in plan.ranks:
        where = "local" if r.local else "remote (ssh)"
        lines.append(f"rank {r.slot.rank}: host {r.slot.hostname} [{where}] local_rank {r.slot.local_rank} "
                     f"cross_rank {r.slot.cross_rank}")
        lines.append(f"  command: {shlex.join(r.argv)}")
        if r.env:
            lines.append("  env: " + " ".join(f"{k}={v}" for k, v in sorted(r.env.items())))
    if commands_text:
        lines.append("Commands horovodrun would run:")
        lines += [f"  {c}" for c in commands_text]
    return "\n".join(lines)
