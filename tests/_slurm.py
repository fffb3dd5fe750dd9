"""A real one-node Slurm cluster (with MUNGE) on this machine, for the ``srun`` tests.

``SlurmCluster().acquire()`` brings up a cluster of its own: Debian's ``slurm-wlm`` and ``munge``
packages (installed with apt-get when missing, without starting their system services), the MUNGE
key the package made, ``munged`` (as the ``munge`` user, shared by the clusters of this machine),
and ``slurmctld`` and ``slurmd`` as root, in the foreground as children of this process, with a
``slurm.conf``, state and spool directories and a cluster name of their own under
``/run/horovod-test-slurm/<name>``, on two TCP ports found free when it starts (never Slurm's default
6817/6818, where another Slurm of the machine may listen). The node is this machine (its host name,
at 127.0.0.1) with 8 CPUs whatever ``nproc`` says (``SlurmdParameters=config_overrides``), so that
``srun -n 3`` runs on a 2-core machine. ``env()`` gives ``SLURM_CONF`` for the client commands
(``srun``, ``sbatch``, ``squeue``...): every command a test runs goes to this cluster's controller.

Before a test may use it, ``acquire()`` checks that the daemons answering are the ones it started:
the two ports are listened on by the two processes it started (and by nothing else), ``scontrol
show config`` (asked of the controller) reports this cluster's name, ports and state directory,
``scontrol show slurmd`` reports the slurmd it started, and ``sinfo`` shows the node up. Anything
else raises :class:`SlurmError` at once, naming what answers instead; nothing is submitted.

A cluster belongs to the process that made it; ``release()`` ends its jobs and stops its daemons. A
cluster whose process died is stopped by the next ``acquire()`` on the machine.

Needs Linux, root and apt (or the packages already there). :func:`unavailable_reason` says why it
cannot run here, or returns None. A fixture of this repository's tests, not part of the package.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tests import _apt
from tests._procs import alive as _alive
from tests._procs import cmdline as _cmdline
from tests._procs import locked
from tests._procs import proc_start as _proc_start

__all__ = ["SlurmCluster", "SlurmError", "port_owners", "unavailable_reason"]

BASE_DIR = Path("/run/horovod-test-slurm")
LOCK_FILE = Path("/run/lock/horovod-test-slurm.lock")
MUNGE_SOCKET_DIR = Path("/run/munge")
DEFAULT_PORTS = (6817, 6818)  # Slurm's own: never ours
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


def _locked() -> contextlib.AbstractContextManager[None]:
    return locked(LOCK_FILE)


# ----------------------------------------------------------------- processes and ports


def _listening_inodes(port: int) -> set[str]:
    """The inodes of the TCP sockets listening on ``port`` (IPv4 and IPv6) in this network namespace."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f[9])
    return inodes


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    out.add(link[8:-1])
    return out


def port_owners(port: int) -> dict[int, str]:
    """The processes listening on TCP ``port`` here: pid -> command line (empty when none does)."""
    inodes = _listening_inodes(port)
    if not inodes:
        return {}
    owners = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _socket_inodes(int(entry)) & inodes:
            owners[int(entry)] = " ".join(_cmdline(int(entry))) or "?"
    return owners or {-1: "a process this one cannot see"}


def _free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick; never 6817/6818)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if port not in DEFAULT_PORTS and not _listening_inodes(port):
            return port


def _munge_works() -> bool:
    try:
        cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        if cred.returncode != 0:
            return False
        res = subprocess.run(["unmunge"], input=cred.stdout, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0


def _stop_pid(pid: int, conf: Path, grace: float = 10.0) -> None:
    """SIGTERM then SIGKILL ``pid``, only while it is a Slurm daemon of the cluster configured by ``conf``."""
    def ours() -> bool:
        return _alive(pid) and str(conf) in _cmdline(pid)

    if not ours():
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and ours():
        time.sleep(0.1)
    if ours():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _config_values(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^(\w+)\s*=\s*(.*)$", text, re.M)}


class SlurmCluster:
    """One cluster of this process; ``acquire()`` to start it, ``release()`` when done.

    ``ports`` (controller, slurmd) are picked free by default; a test may force them to see the
    checks refuse a port another process holds.
    """

    def __init__(self, base: Path = BASE_DIR, ports: tuple[int, int] | None = None) -> None:
        self.base = base
        self.name = f"hvd{os.getpid()}x{secrets.token_hex(2)}"  # ClusterName: lower case, short
        self.dir = base / self.name
        self.conf = self.dir / "slurm.conf"
        self.node = socket.gethostname()
        self._forced_ports = ports
        self.ctld_port = self.slurmd_port = 0
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._verified = False  # verify() passed: the client commands reach this cluster's daemons

    def env(self) -> dict[str, str]:
        """The variables Slurm's client commands need (on top of the caller's environment)."""
        return {"SLURM_CONF": str(self.conf)}

    def _client_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return dict(env, **self.env())

    @property
    def pids(self) -> dict[str, int]:
        """The daemons this cluster started: name -> pid."""
        return {k: p.pid for k, p in self._procs.items()}

    # ----------------------------------------------------------------- life
    def acquire(self) -> SlurmCluster:
        reason = unavailable_reason()
        if reason:
            raise SlurmError(reason)
        try:
            with _locked():
                _reap_orphans(self.base)
                self._start()
            self.verify()
            self.wait_idle()
        except BaseException:
            self.release()
            raise
        return self

    def release(self) -> None:
        """End this cluster's jobs, stop its daemons and remove its directory (munged too when the last
        cluster of the machine that needed it is gone and a fixture started it)."""
        if self._verified and self._answering_ourselves():
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):  # no task outlives slurmd
                env = self._client_env()
                jobs = _sh(["squeue", "-h", "-o", "%i"], check=False, env=env, timeout=20).stdout.split()
                if jobs:
                    _sh(["scancel", *jobs], check=False, env=env, timeout=20)
        grace = 10.0 if self._verified else 1.0  # a slurmctld still retrying its bind ignores SIGTERM
        self._verified = False
        for name in ("slurmd", "slurmctld"):
            proc = self._procs.pop(name, None)
            if proc is not None:
                _stop_pid(proc.pid, self.conf, grace)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
        with _locked():
            shutil.rmtree(self.dir, ignore_errors=True)
            _munge_release(self.base)

    # ----------------------------------------------------------------- daemons
    def _answering_ourselves(self) -> bool:
        """Both daemons alive and the only listeners on this cluster's ports (no jobs cancelled elsewhere)."""
        return len(self._procs) == 2 and all(
            proc.poll() is None and set(port_owners(port)) == {proc.pid}
            for proc, port in ((self._procs["slurmctld"], self.ctld_port), (self._procs["slurmd"], self.slurmd_port)))

    def _conf_text(self) -> str:
        d = self.dir
        return "\n".join([
            "# made by the test suite's Slurm fixture (tests/_slurm.py); removed with its cluster",
            f"ClusterName={self.name}", f"SlurmctldHost={self.node}(127.0.0.1)",
            "SlurmUser=root", "SlurmdUser=root", f"SlurmctldPort={self.ctld_port}", f"SlurmdPort={self.slurmd_port}",
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

    def _start(self) -> None:
        """Under the lock: ports, directories, conf, munged, then both daemons in the foreground."""
        if self._forced_ports:
            self.ctld_port, self.slurmd_port = self._forced_ports
            for port in self._forced_ports:
                owners = port_owners(port)
                if owners:
                    raise SlurmError(f"port {port} for the test cluster {self.name} is already listened on by "
                                     f"{_describe(owners)}: not starting a Slurm there")
        else:
            self.ctld_port = _free_port()
            self.slurmd_port = _free_port()
            while self.slurmd_port == self.ctld_port:
                self.slurmd_port = _free_port()
        d = self.dir
        self.base.mkdir(parents=True, exist_ok=True)
        self.base.chmod(0o755)
        for sub in ("state", "spool"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        d.chmod(0o755)  # other users (the tests' stranger) read slurm.conf to run squeue
        (d / "owner").write_text(f"{os.getpid()} {_proc_start(os.getpid())}")
        self.conf.write_text(self._conf_text())
        self.conf.chmod(0o644)
        _munge_acquire(self.base)
        env = self._client_env()
        for name in ("slurmctld", "slurmd"):
            with open(d / f"{name}.out", "ab") as out:
                self._procs[name] = subprocess.Popen(
                    [f"/usr/sbin/{name}", "-D", "-f", str(self.conf)], env=env, stdin=subprocess.DEVNULL,
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        (d / "daemons").write_text(" ".join(str(p.pid) for p in self._procs.values()))  # for _reap_orphans

    def _logs(self) -> str:
        parts = []
        for f in ("slurmctld.log", "slurmctld.out", "slurmd.log", "slurmd.out"):
            with contextlib.suppress(OSError):
                text = (self.dir / f).read_text(errors="replace")[-800:]
                if text.strip():
                    parts.append(f"--- {f}:\n{text}")
        return "\n".join(parts)

    def _fail(self, what: str) -> SlurmError:
        return SlurmError(f"the test Slurm cluster {self.name} (conf {self.conf}, controller port {self.ctld_port}, "
                          f"slurmd port {self.slurmd_port}): {what}\n{self._logs()}")

    def verify(self, timeout: float = 60.0) -> None:
        """Raise :class:`SlurmError` unless the daemons answering on this cluster's ports and conf are
        the ones it started (see the module's docstring). Fails at once when another process holds a
        port or a daemon exited; waits (up to ``timeout``) only while they are still starting."""
        deadline = time.monotonic() + timeout
        ports = {"slurmctld": self.ctld_port, "slurmd": self.slurmd_port}
        while True:  # the ports: listened on by our daemons, by nothing else
            pending = []
            for name, port in ports.items():
                proc = self._procs.get(name)
                if proc is None or proc.poll() is not None:
                    rc = None if proc is None else proc.returncode
                    owners = port_owners(port)
                    held = f"; port {port} is held by {_describe(owners)}" if owners else ""
                    raise self._fail(f"{name} exited (status {rc}) before it answered{held}")
                owners = port_owners(port)
                strangers = {p: c for p, c in owners.items() if p != proc.pid}
                if strangers:
                    raise self._fail(f"port {port} (for {name}, pid {proc.pid}) is listened on by "
                                     f"{_describe(strangers)}, not by the {name} this fixture started")
                if proc.pid not in owners:
                    pending.append(f"{name} (pid {proc.pid}) not listening on {port} yet")
            if not pending:
                break
            if time.monotonic() > deadline:
                raise self._fail("; ".join(pending) + f" after {timeout:g} s")
            time.sleep(0.1)
        env = self._client_env()
        res = _sh(["scontrol", "show", "config"], check=False, env=env, timeout=30)
        got = _config_values(res.stdout)
        want = {"ClusterName": self.name, "SlurmctldPort": str(self.ctld_port), "SlurmdPort": str(self.slurmd_port),
                "StateSaveLocation": str(self.dir / "state")}
        wrong = {k: got.get(k) for k, v in want.items() if got.get(k) != v}
        if res.returncode != 0 or wrong:
            raise self._fail(f"the controller answering 'scontrol show config' is not this cluster's: expected "
                             f"{want}, it says {wrong} (exit {res.returncode}: {res.stderr.strip()[-300:]})")
        if " is UP" not in res.stdout:
            raise self._fail(f"'scontrol show config' does not report the controller up: {res.stdout[-300:]}")
        res = _sh(["scontrol", "show", "slurmd"], check=False, env=env, timeout=30)
        m = re.search(r"Slurmd PID\s*=\s*(\d+)", res.stdout)
        if res.returncode != 0 or not m or int(m.group(1)) != self._procs["slurmd"].pid:
            raise self._fail(f"the slurmd answering on port {self.slurmd_port} is not the one started (pid "
                             f"{self._procs['slurmd'].pid}): 'scontrol show slurmd' says "
                             f"{(res.stdout or res.stderr).strip()[-300:]!r}")
        self._verified = True

    def wait_idle(self, timeout: float = 90.0) -> None:
        """Until ``sinfo`` shows the node idle (or mixed/allocated: in use)."""
        deadline, last = time.monotonic() + timeout, ""
        while True:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise self._fail(f"{name} (pid {proc.pid}) exited with status {proc.returncode}")
            res = _sh(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, env=self._client_env())
            last = (res.stdout or res.stderr).strip()
            if res.returncode == 0 and any(w in last.split() for w in ("idle", "mix", "alloc")):
                return
            if time.monotonic() > deadline:
                raise self._fail(f"the node did not come up in {timeout:g} s: sinfo says {last!r}")
            time.sleep(0.3)


def _describe(owners: dict[int, str]) -> str:
    return ", ".join(f"pid {p} ({c[:120]})" for p, c in sorted(owners.items()))


def _owner_alive(d: Path) -> bool:
    try:
        pid, start = (d / "owner").read_text().split()
    except (OSError, ValueError):
        return False
    return _proc_start(int(pid)) == start


def _reap_orphans(base: Path) -> None:
    """Under the lock: stop the daemons of clusters whose process died (killed before its release)."""
    if not base.is_dir():
        return
    for d in base.iterdir():
        if not d.is_dir() or _owner_alive(d):
            continue
        with contextlib.suppress(OSError, ValueError):
            for pid in (d / "daemons").read_text().split():
                _stop_pid(int(pid), d / "slurm.conf")
        shutil.rmtree(d, ignore_errors=True)


def _munge_acquire(base: Path) -> None:
    """Under the lock: a working munged, started (and recorded as the fixture's) when there is none."""
    if _munge_works():
        return
    MUNGE_SOCKET_DIR.mkdir(mode=0o755, exist_ok=True)
    shutil.chown(MUNGE_SOCKET_DIR, "munge", "munge")
    if not Path("/etc/munge/munge.key").exists():
        _sh(["runuser", "-u", "munge", "--", "mungekey", "--create"])
    _sh(["runuser", "-u", "munge", "--", "/usr/sbin/munged"])
    pid = Path("/run/munge/munged.pid").read_text().strip()
    (base / "munged.pid").write_text(pid)  # ours: stopped with the machine's last test cluster
    deadline = time.monotonic() + 30
    while not _munge_works():
        if time.monotonic() > deadline:
            raise SlurmError("munged started but munge -n | unmunge does not work")
        time.sleep(0.2)


def _munge_release(base: Path) -> None:
    """Under the lock: stop the munged a fixture started once no live cluster is left."""
    pidfile = base / "munged.pid"
    if not pidfile.exists() or any(d.is_dir() and _owner_alive(d) for d in base.iterdir()):
        return
    with contextlib.suppress(OSError, ValueError):
        pid = int(pidfile.read_text().split()[0])
        if _alive(pid) and any(Path(a).name == "munged" for a in _cmdline(pid)[:1]):
            os.kill(pid, signal.SIGTERM)
    pidfile.unlink(missing_ok=True)
