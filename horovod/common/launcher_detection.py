"""Which launcher started this process, and how Horovod joins its job. Pure logic on an env dict.

``detect(environ, torch_group)`` is the one place that decides; ``hvd.init()`` of every binding
calls it (through ``horovod.common.backends.registry``). Precedence, first match wins:

1. ``HOROVOD_CONTROLLER`` / ``HOROVOD_CPU_OPERATIONS`` name the transport explicitly; the launcher
   is still detected below (its ranks and store are used). Gloo joins every launcher (under
   ``mpirun`` the ranks meet through MPI); MPI needs an MPI launcher's variables when the job has
   more than one process, else it is a ``LauncherError``.
2. ``HOROVOD_GLOO_RENDEZVOUS_ADDR``: a Horovod launcher (Gloo).
3. An MPI launcher (``OMPI_COMM_WORLD_SIZE``, ``PMI_SIZE``, ``PMIX_RANK``...): MPI.
4. An already-initialised default ``torch.distributed`` group (Ray Train's ``TorchTrainer``,
   Lightning's DDP, Accelerate): Gloo groups made on that group's store.
5. torchrun / a torch elastic agent (``TORCHELASTIC_RUN_ID``/``GROUP_RANK``, or ``RANK`` +
   ``WORLD_SIZE``; Spark's ``TorchDistributor`` runs torchrun): Gloo on ``MASTER_ADDR:MASTER_PORT``.
6. Slurm ``srun`` (``SLURM_PROCID`` with ``SLURM_STEP_NUM_TASKS`` or ``SLURM_NTASKS``, inside a step):
   Gloo on an authenticated store opened by task 0 on the step's first node.
7. Nothing: a job of one process.

A launcher whose variables say the world is larger than one but which lacks what Horovod needs to
join it is a ``LauncherError`` naming the variables seen and those missing: Horovod never runs
silently alone.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from horovod.common import protocol, slurm_ports
from horovod.common.exceptions import HorovodError

__all__ = ["Launch", "LauncherError", "detect", "expand_nodelist", "first_node", "torch_default_group",
           "LAUNCHER_VARIABLES"]

MPI_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "PMI_RANK")
TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                   "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                   "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")
SLURM_VARIABLES = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_NODEID",
                   "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_ID", "SLURM_STEP_ID",
                   "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_STEP_TASKS_PER_NODE")
HOROVOD_VARIABLES = (protocol.RENDEZVOUS_ADDR_ENV, protocol.RENDEZVOUS_PORT_ENV, "HOROVOD_RANK",
                     "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CONTROLLER",
                     "HOROVOD_CPU_OPERATIONS")
LAUNCHER_VARIABLES = HOROVOD_VARIABLES + MPI_VARIABLES + TORCH_VARIABLES + SLURM_VARIABLES


class LauncherError(HorovodError, RuntimeError):
    """The process was started by a launcher of a larger job that Horovod cannot join."""


@dataclass(frozen=True)
class Launch:
    """What ``detect`` found.

    ``launcher`` is one of ``horovod``, ``mpi``, ``torch-group``, ``torchrun``, ``slurm``, ``none``;
    ``transport`` one of ``gloo``, ``mpi``, ``local``. ``rank``/``size``/``local_rank``/
    ``local_size``/``node_rank`` are the launcher's own numbers where it gives them (None otherwise);
    ``master_addr``/``master_port`` where the ranks meet; ``master_is_store`` says whether a store
    already listens there (torchrun's agent) or task 0 must open it; ``scope`` tells apart the
    store keys of successive restarts of one job. ``key_port``: the port task 0's srun key service
    listened on (MUNGE; known on task 0 once the ranks have met, else None).

    ``detect`` names the first of an srun step's candidate ports; once the ranks have met,
    ``hvd.init()``'s launch names the port task 0 bound (:meth:`met`), a later candidate when
    another process held the first (``horovod.common.slurm_ports``).
    """

    launcher: str
    transport: str
    rank: int | None = None
    size: int | None = None
    local_rank: int | None = None
    local_size: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    master_is_store: bool = False
    scope: str = ""
    seen: Mapping[str, str] = field(default_factory=dict)
    key_port: int | None = None

    def met(self, found: Launch | None) -> Launch:
        """This launch with where its ranks met as ``found`` says (a rendezvous handler's launch
        after the meeting: the store's address and the ports task 0 bound); itself when ``found``
        is None (the ranks met through Horovod's own launcher)."""
        if found is None:
            return self
        return replace(self, master_addr=found.master_addr, master_port=found.master_port,
                       key_port=found.key_port)

    def describe(self) -> str:
        """One line for logs and diagnostics (variable names and values; never a secret)."""
        where = f" at {self.master_addr}:{self.master_port}" if self.master_addr else ""
        nums = f" rank {self.rank} of {self.size}" if self.size is not None else ""
        local = (f", local rank {self.local_rank} of {self.local_size}"
                 if self.local_size is not None else "")
        seen = ", ".join(f"{k}={v}" for k, v in self.seen.items())
        return (f"launcher {self.launcher} (transport {self.transport}){nums}{local}{where}"
                + (f"; variables: {seen}" if seen else ""))


def _int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise LauncherError(f"{name}={raw!r} is not an integer; the launcher that set it is "
                            "misconfigured.", variable=name) from None


def _seen(environ: Mapping[str, str], names: tuple[str, ...]) -> dict[str, str]:
    return {k: environ[k] for k in names if k in environ}


def _missing(launcher: str, seen: Mapping[str, str], missing: list[str], why: str) -> LauncherError:
    shown = ", ".join(f"{k}={v}" for k, v in seen.items()) or "none"
    return LauncherError(
        f"Horovod was started by {launcher} for a job of more than one process but cannot join it: "
        f"{why}. Variables seen: {shown}. Missing: {', '.join(missing)}. Start the job so that "
        "these are set (torchrun, srun, horovodrun or mpirun set them), or unset the others to run "
        "one process alone.", launcher=launcher, missing=tuple(missing))


# ------------------------------------------------------------------------------ Slurm node lists
def expand_nodelist(text: str) -> list[str]:
    """Expand Slurm's compressed host list: ``"n[01-03,7],gpu5"`` -> ``[n01, n02, n03, n7, gpu5]``.

    Ranges keep their zero padding; several bracket groups in one name multiply out
    (``"r[1-2]n[1-2]"`` -> ``r1n1, r1n2, r2n1, r2n2``).

    Raises:
        ValueError: unbalanced brackets or a bad range.
    """
    names: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in Slurm node list {text!r}")
        elif ch == "," and depth == 0:
            part = text[start:i].strip()
            if part:
                names.extend(_expand_one(part, text))
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in Slurm node list {text!r}")
    return names


def _expand_one(part: str, text: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", part)
    if m is None:
        return [part]
    prefix, rest = part[:m.start()], part[m.end():]
    tails = _expand_one(rest, text) if rest else [""]
    out: list[str] = []
    for item in m.group(1).split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r} in Slurm node list {text!r}")
        if not sep:
            values = [lo]
        else:
            if int(hi) < int(lo):
                raise ValueError(f"bad range {item!r} in Slurm node list {text!r}")
            values = [str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1)]
        out.extend(prefix + v + tail for v in values for tail in tails)
    return out


def first_node(text: str) -> str:
    """The first host of a Slurm node list (where task 0 of a block-distributed step runs)."""
    nodes = expand_nodelist(text)
    if not nodes:
        raise ValueError(f"empty Slurm node list {text!r}")
    return nodes[0]


def _slurm_port(environ: Mapping[str, str]) -> int:
    """The first of the store's candidate ports, which every task of a step derives alike from the
    job and step ids (``horovod.common.slurm_ports``: task 0 falls back to the next ones)."""
    return slurm_ports.step_ports(environ)[0]


# ------------------------------------------------------------------------------ torch group probe
def torch_default_group() -> tuple[int, int] | None:
    """(rank, size) of an initialised default ``torch.distributed`` group, else None.

    Looks only at a ``torch.distributed`` the program already imported: it never imports torch.
    """
    dist: Any = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not dist.is_available() or not dist.is_initialized():
            return None
        return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:  # noqa: BLE001 - a half-initialised torch is "no group"
        return None


# ------------------------------------------------------------------------------ detection
def detect(environ: Mapping[str, str], torch_group: tuple[int, int] | None = None,
           explicit: str = "", comm: Any = None, explicit_variable: str = "HOROVOD_CONTROLLER") -> Launch:
    """Decide the launcher and transport (see the module docstring for the order).

    Args:
        environ: the process environment.
        torch_group: ``(rank, size)`` of an initialised default torch group (``torch_default_group()``).
        explicit: ``HOROVOD_CONTROLLER``/``HOROVOD_CPU_OPERATIONS`` (lower case), if set: it
            replaces the transport; the launcher is still detected (its ranks and store are used).
        comm: what ``hvd.init(comm=...)`` got (an mpi4py communicator or a list of ranks).
        explicit_variable: the variable ``explicit`` came from (named in errors).

    Raises:
        LauncherError: a launcher says the world is larger than one and cannot be joined, also
            not with the explicit transport (see :func:`_check_explicit`).
    """
    launch = _detect(environ, torch_group, comm)
    if explicit and explicit != launch.transport:
        _check_explicit(environ, launch, explicit, explicit_variable, comm)
        return replace(launch, transport=explicit)
    return launch


def _launcher_name(launch: Launch) -> str:
    return {"horovod": "horovodrun --gloo (HOROVOD_GLOO_RENDEZVOUS_ADDR)", "mpi": "mpirun/mpiexec",
            "torch-group": "an initialised torch.distributed group", "torchrun": "torchrun",
            "slurm": "srun"}.get(launch.launcher, launch.launcher)


def _check_explicit(environ: Mapping[str, str], launch: Launch, explicit: str, variable: str,
                    comm: Any) -> None:
    """An explicit transport the launcher cannot give is an error, never a job of one process.

    MPI needs an MPI launcher (``mpirun``'s variables): under any other launcher of more than one
    process, ``MPI_Init`` makes every rank a world of its own. Gloo joins every launcher: under
    ``mpirun`` its ranks meet through MPI (``horovod.common.backends.factories.create_gloo``).
    """
    if explicit == "mpi" and launch.launcher != "mpi" and comm is None:
        if any(k in environ for k in MPI_VARIABLES):
            return  # an MPI launcher started it too (horovodrun's MPI mode): MPI joins its job
        if launch.size is not None and launch.size <= 1:
            return  # a job of one process: MPI's singleton is the whole world
        if launch.launcher == "none":
            return
        count = "an unknown number" if launch.size is None else str(launch.size)
        raise LauncherError(
            f"{variable}=mpi asks for the MPI transport, but this process was started by "
            f"{_launcher_name(launch)} for a job of {count} processes, not by an MPI launcher "
            f"(variables seen: {', '.join(f'{k}={v}' for k, v in launch.seen.items()) or 'none'}; "
            f"missing: {', '.join(MPI_VARIABLES[:3])}). MPI would make every rank a world of its own. "
            f"Start the job with `mpirun` (or `horovodrun --mpi`), or unset {variable} to use Gloo "
            f"on what {_launcher_name(launch)} gives.", launcher=launch.launcher, variable=variable,
            missing=MPI_VARIABLES[:3])


def _detect(environ: Mapping[str, str], torch_group: tuple[int, int] | None, comm: Any) -> Launch:
    if comm is not None and not isinstance(comm, (list, tuple)):
        return Launch("mpi", "mpi", seen=_seen(environ, MPI_VARIABLES))
    if protocol.RENDEZVOUS_ADDR_ENV in environ:
        return Launch("horovod", "gloo", rank=_int(environ, "HOROVOD_RANK"),
                      size=_int(environ, "HOROVOD_SIZE"), local_rank=_int(environ, "HOROVOD_LOCAL_RANK"),
                      local_size=_int(environ, "HOROVOD_LOCAL_SIZE"),
                      seen=_seen(environ, (protocol.RENDEZVOUS_ADDR_ENV, protocol.RENDEZVOUS_PORT_ENV,
                                           "HOROVOD_RANK", "HOROVOD_SIZE")))
    if any(k in environ for k in MPI_VARIABLES) or comm is not None:
        return Launch("mpi", "mpi", seen=_seen(environ, MPI_VARIABLES))
    if torch_group is not None:
        rank, size = torch_group
        return Launch("torch-group", "gloo" if size > 1 else "local", rank=rank, size=size,
                      local_rank=_int(environ, "LOCAL_RANK"), local_size=_int(environ, "LOCAL_WORLD_SIZE"),
                      node_rank=_int(environ, "GROUP_RANK"), scope=_torch_scope(environ),
                      seen=_seen(environ, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")))
    torch_launch = _torchrun(environ)
    if torch_launch is not None:
        return torch_launch
    slurm = _slurm(environ)
    if slurm is not None:
        return slurm
    return Launch("none", "local", rank=0, size=1)


def _torch_scope(environ: Mapping[str, str]) -> str:
    return f"{environ.get('TORCHELASTIC_RUN_ID', 'env')}.{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _torchrun(environ: Mapping[str, str]) -> Launch | None:
    elastic = "TORCHELASTIC_RUN_ID" in environ or "GROUP_RANK" in environ
    if not elastic and "WORLD_SIZE" not in environ:
        return None
    seen = _seen(environ, TORCH_VARIABLES)
    size = _int(environ, "WORLD_SIZE")
    rank = _int(environ, "RANK")
    if size is None or size <= 1:
        if size is None and elastic:
            raise _missing("torchrun", seen, ["WORLD_SIZE"], "the torch elastic agent's variables "
                           "are incomplete")
        return Launch("torchrun", "local", rank=0, size=1, seen=seen)
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not environ.get(k)]
    if missing:
        raise _missing("torchrun" if elastic else "a torch launcher (WORLD_SIZE)", seen, missing,
                       "the address where the ranks meet is not known")
    assert rank is not None
    if not 0 <= rank < size:
        raise LauncherError(f"RANK={rank} is outside WORLD_SIZE={size}.", launcher="torchrun")
    use_agent = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true")
    return Launch("torchrun", "gloo", rank=rank, size=size, local_rank=_int(environ, "LOCAL_RANK"),
                  local_size=_int(environ, "LOCAL_WORLD_SIZE"), node_rank=_int(environ, "GROUP_RANK"),
                  master_addr=environ["MASTER_ADDR"], master_port=_int(environ, "MASTER_PORT"),
                  master_is_store=use_agent, scope=_torch_scope(environ), seen=seen)


def _slurm(environ: Mapping[str, str]) -> Launch | None:
    # A task of an srun step (a batch script itself has SLURM_NTASKS but no step task count).
    if "SLURM_PROCID" not in environ or "SLURM_STEP_NUM_TASKS" not in environ:
        return None
    seen = _seen(environ, SLURM_VARIABLES)
    size = _int(environ, "SLURM_STEP_NUM_TASKS") or _int(environ, "SLURM_NTASKS") or 1
    rank = _int(environ, "SLURM_PROCID") or 0
    if size <= 1:
        return Launch("slurm", "local", rank=0, size=1, seen=seen)
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_NODELIST")
    addr = environ.get("MASTER_ADDR")
    if not addr:
        if not nodelist:
            raise _missing("srun", seen, ["SLURM_STEP_NODELIST"], "the first node's name is not known")
        try:
            addr = first_node(nodelist)
        except ValueError as exc:
            raise LauncherError(f"SLURM_STEP_NODELIST={nodelist!r}: {exc}.", launcher="slurm") from exc
    port = _int(environ, "MASTER_PORT") or _slurm_port(environ)
    return Launch("slurm", "gloo", rank=rank, size=size, local_rank=_int(environ, "SLURM_LOCALID"),
                  node_rank=_int(environ, "SLURM_NODEID"), master_addr=addr, master_port=port,
                  master_is_store=False,
                  scope=f"{environ.get('SLURM_JOB_ID', '0')}.{environ.get('SLURM_STEP_ID', '0')}", seen=seen)
