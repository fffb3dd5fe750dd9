"""A real one-node Slurm cluster (with MUNGE) on this machine, for the ``srun`` tests.

``SlurmCluster.acquire()`` brings up, or joins, one cluster: Debian's ``slurm-wlm`` and ``munge``
packages (installed with apt-get when missing, without starting their system services), the MUNGE
key the package made, ``munged`` (as the ``munge`` user), and ``slurmctld`` and ``slurmd`` as root
with a ``slurm.conf`` of their own under ``/run/horovod-slurm``. The node is this machine (its host
name, at 127.0.0.1) with 8 CPUs whatever ``nproc`` says (``SlurmdParameters=config_overrides``), so
that ``srun -n 3`` runs on a 2-core machine. ``env()`` gives ``SLURM_CONF`` for the client commands
(``srun``, ``sbatch``, ``squeue``...).

Several test processes may use the cluster at once: each registers under ``users/`` and
``release()`` stops the daemons (and the ``munged`` it started) only when no live user is left; a
cluster whose users all died is stopped and remade by the next ``acquire()``.

Needs Linux, root and apt (or the packages already there). :func:`unavailable_reason` says why it
cannot run here, or returns None. A fixture of this repository's tests, not part of the package.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from tests import _apt

__all__ = ["SlurmCluster", "SlurmError", "unavailable_reason"]

RUN_DIR = Path("/run/horovod-slurm")
LOCK_FILE = Path("/run/lock/horovod-slurm.lock")
MUNGE_SOCKET_DIR = Path("/run/munge")
CTLD_PORT, SLURMD_PORT = 6817, 6818
CPUS = 8

# command -> Debian package providing it
_PACKAGES = {"/usr/sbin/slurmctld": "slurmctld", "/usr/sbin/slurmd": "slurmd", "srun": "slurm-client",
             "sinfo": "slurm-client", "sbatch": "slurm-client", "/usr/sbin/munged": "munge",
             "munge": "munge", "unmunge": "munge"}


class SlurmError(RuntimeError):
    """The cluster could not be brought up or used."""


def _sh(argv: Sequence[str], *, check: bool = True, timeout: float = 60,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env)
    if check and res.returncode != 0:
        raise SlurmError(f"{' '.join(argv)} failed (exit {res.returncode}): {(res.stderr or res.stdout).strip()}")
    return res


def _install_packages() -> str | None:
    """Install what is missing with apt-get; the reason it failed, or None."""
    return _apt.install_missing(_PACKAGES, "a Slurm cluster")


@functools.cache
def unavailable_reason() -> str | None:
    """Why a Slurm cluster cannot be brought up on this machine, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "the Slurm fixture needs Linux"
    if os.geteuid() != 0:
        return "the Slurm fixture needs root (slurmd runs the tasks, munged needs its key)"
    with _locked():
        return _install_packages()


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK_FILE, "a") as fd:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


def _proc_start(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_alive(pidfile: Path) -> int | None:
    try:
        pid = int(pidfile.read_text().split()[0])
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return None
    return pid if state not in ("Z", "X") else None


def _stop(pidfile: Path, grace: float = 10.0) -> None:
    pid = _pid_alive(pidfile)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _pid_alive(pidfile) == pid:
        time.sleep(0.1)
    if _pid_alive(pidfile) == pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _munge_works() -> bool:
    try:
        cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        if cred.returncode != 0:
            return False
        res = subprocess.run(["unmunge"], input=cred.stdout, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0


class SlurmCluster:
    """The one-node cluster; ``acquire()`` to use it, ``release()`` when done."""

    def __init__(self) -> None:
        self.dir = RUN_DIR
        self.conf = RUN_DIR / "slurm.conf"
        self.node = socket.gethostname()
        self._user_file: Path | None = None

    def env(self) -> dict[str, str]:
        """The variables Slurm's client commands need (on top of the caller's environment)."""
        return {"SLURM_CONF": str(self.conf)}

    # ----------------------------------------------------------------- users
    def _live_users(self) -> list[Path]:
        live = []
        for f in (self.dir / "users").glob("*"):
            try:
                pid, start = f.read_text().split()
            except (OSError, ValueError):
                f.unlink(missing_ok=True)
                continue
            if _proc_start(int(pid)) == start:
                live.append(f)
            else:
                f.unlink(missing_ok=True)
        return live

    def acquire(self) -> SlurmCluster:
        reason = unavailable_reason()
        if reason:
            raise SlurmError(reason)
        with _locked():
            users = self._live_users() if (self.dir / "users").is_dir() else []
            if not users or not self._daemons_alive():
                self._down()
                self._up()
            (self.dir / "users").mkdir(parents=True, exist_ok=True)
            self._user_file = self.dir / "users" / str(os.getpid())
            self._user_file.write_text(f"{os.getpid()} {_proc_start(os.getpid())}")
        self.wait_idle()
        return self

    def release(self) -> None:
        if self._user_file is None:
            return
        with _locked():
            self._user_file.unlink(missing_ok=True)
            self._user_file = None
            if not self._live_users():
                self._down()

    # ----------------------------------------------------------------- daemons
    def _daemons_alive(self) -> bool:
        return all(_pid_alive(self.dir / f) for f in ("slurmctld.pid", "slurmd.pid"))

    def _conf_text(self) -> str:
        d = self.dir
        return "\n".join([
            "# made by the test suite's Slurm fixture; removed when the last test process is done",
            "ClusterName=horovodtest", f"SlurmctldHost={self.node}(127.0.0.1)",
            "SlurmUser=root", "SlurmdUser=root", f"SlurmctldPort={CTLD_PORT}", f"SlurmdPort={SLURMD_PORT}",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}", f"SlurmdLogFile={d / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none", "SwitchType=switch/none", "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            # Take CPUs= from here, not from the hardware: srun -n 3 on a 2-core machine.
            "SlurmdParameters=config_overrides", "ReturnToService=2", "KillWait=5", "InactiveLimit=0",
            "MinJobAge=300",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={CPUS} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
            ""])

    def _up(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "users"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        d.chmod(0o755)  # other users (the tests' stranger) read slurm.conf to run squeue
        self.conf.write_text(self._conf_text())
        self.conf.chmod(0o644)
        if not _munge_works():
            MUNGE_SOCKET_DIR.mkdir(mode=0o755, exist_ok=True)
            shutil.chown(MUNGE_SOCKET_DIR, "munge", "munge")
            key = Path("/etc/munge/munge.key")
            if not key.exists():
                _sh(["runuser", "-u", "munge", "--", "mungekey", "--create"])
            _sh(["runuser", "-u", "munge", "--", "/usr/sbin/munged"])
            pid = Path("/run/munge/munged.pid").read_text().strip()
            (d / "munged.pid").write_text(pid)  # ours: stopped with the cluster
            deadline = time.monotonic() + 30
            while not _munge_works():
                if time.monotonic() > deadline:
                    raise SlurmError("munged started but munge -n | unmunge does not work")
                time.sleep(0.2)
        env = dict(os.environ, SLURM_CONF=str(self.conf))
        _sh(["/usr/sbin/slurmctld", "-f", str(self.conf)], env=env)
        _sh(["/usr/sbin/slurmd", "-f", str(self.conf)], env=env)

    def _down(self) -> None:
        d = self.dir
        if not d.is_dir():
            return
        env = dict(os.environ, SLURM_CONF=str(self.conf))
        if self._daemons_alive():  # end the jobs left running, so that no task outlives slurmd
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                jobs = _sh(["squeue", "-h", "-o", "%i"], check=False, env=env, timeout=20).stdout.split()
                if jobs:
                    _sh(["scancel", *jobs], check=False, env=env, timeout=20)
        _stop(d / "slurmd.pid")
        _stop(d / "slurmctld.pid")
        _stop(d / "munged.pid")
        shutil.rmtree(d, ignore_errors=True)

    def wait_idle(self, timeout: float = 90.0) -> None:
        """Until ``sinfo`` shows the node idle (or mixed/allocated: in use by other tests)."""
        deadline, last = time.monotonic() + timeout, ""
        while True:
            res = _sh(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, env=dict(os.environ, **self.env()))
            last = (res.stdout or res.stderr).strip()
            if res.returncode == 0 and any(w in last.split() for w in ("idle", "mix", "alloc")):
                return
            if time.monotonic() > deadline:
                logs = "".join((self.dir / f).read_text()[-800:] for f in ("slurmctld.log", "slurmd.log")
                               if (self.dir / f).exists())
                raise SlurmError(f"the Slurm node did not come up in {timeout:g} s: sinfo says {last!r}\n{logs}")
            time.sleep(0.3)
