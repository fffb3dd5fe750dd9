"""Several real hosts on one Linux machine, for multi-host tests.

``FakeHosts(n)`` brings up ``n`` hosts. Each is a network namespace with its own address on a
private Linux bridge (no route and no NAT to anything outside the machine), its own host name
(resolvable everywhere through a block in ``/etc/hosts``, removed at close) and its own ``sshd``
accepting a key made for this instance (plain ``ssh HOST cmd`` works from the machine and from
every host, through a drop-in in ``/etc/ssh/ssh_config.d``). The hosts share the file system and
the PID namespace, so the source tree and the interpreter are at the same path everywhere::

    with FakeHosts(2) as fh:
        h1, h2 = fh.hosts
        fh.run(h1, ["ssh", h2, "hostname"])           # -> h2
        fh.kill_host_processes(h2, signal.SIGKILL)    # "host h2 dies"

Several instances may live at once (in one process or several): each takes its own /24 in
10.213.0.0/16, its own interface, namespace and host names. Everything an instance makes is
recorded under ``/run/horovod-fakehosts/<tag>``; ``close()`` (or the ``with`` block, or exit)
removes it, and an instance whose owner died without closing is swept by the next one made.

Needs root, ``ip netns``, ``unshare`` and OpenSSH; missing iproute2 / openssh packages are
installed with apt-get (without starting a system sshd). :func:`unavailable_reason` says why
this machine cannot, or returns None. A fixture of this repository's tests (and of
``benchmarks/run_hierarchical.py``), not part of the installed package.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests import _apt
from tests._procs import alive as _alive
from tests._procs import locked
from tests._procs import proc_start as _proc_start

__all__ = ["FakeHosts", "FakeHostsError", "unavailable_reason"]

RUN_DIR = Path("/run/horovod-fakehosts")
LOCK_FILE = Path("/run/lock/horovod-fakehosts.lock")
SSH_DROPIN_DIR = Path("/etc/ssh/ssh_config.d")
ETC_HOSTS = Path("/etc/hosts")
SSHD = "/usr/sbin/sshd"
NET_BASE = "10.213"  # instance k uses 10.213.k.0/24: hosts .1..n, the machine .254
MAX_HOSTS = 16

# command -> Debian package providing it
_PACKAGES = {"ip": "iproute2", SSHD: "openssh-server", "ssh": "openssh-client",
             "ssh-keygen": "openssh-client", "unshare": "util-linux", "hostname": "hostname"}


class FakeHostsError(RuntimeError):
    """A fake host could not be made, reached or removed."""


def _sh(argv: Sequence[str], *, check: bool = True, timeout: float = 60,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, input=input)
    if check and res.returncode != 0:
        raise FakeHostsError(f"{' '.join(argv)} failed (exit {res.returncode}): "
                             f"{(res.stderr or res.stdout).strip()}")
    return res


def _install_packages() -> str | None:
    """Install what is missing with apt-get; the reason it failed, or None."""
    return _apt.install_missing(_PACKAGES, "fake hosts")


@functools.cache
def unavailable_reason() -> str | None:
    """Why fake hosts cannot be made on this machine, or None when they can."""
    if not sys.platform.startswith("linux"):
        return "fake hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "fake hosts need root (network namespaces, a bridge and sshd)"
    with _locked():
        reason = _install_packages()
    if reason:
        return reason
    probe = f"hfprobe{os.getpid()}"
    try:
        res = _sh(["ip", "netns", "add", probe], check=False)
        if res.returncode != 0:
            return f"cannot create a network namespace (ip netns add): {res.stderr.strip()}"
        res = _sh(["ip", "netns", "exec", probe, "unshare", "--uts", "--", "hostname", probe],
                  check=False)
        if res.returncode != 0:
            return f"cannot give a namespace its own host name (unshare --uts): {res.stderr.strip()}"
    finally:
        _sh(["ip", "netns", "del", probe], check=False)
    return None


def _locked() -> contextlib.AbstractContextManager[None]:
    """One process at a time allocates, sweeps and edits the shared files (/etc/hosts)."""
    return locked(LOCK_FILE)


def _netns_pids(netns: str) -> list[int]:
    """Live PIDs (other than ours, zombies left out) whose network namespace is ``netns``."""
    try:
        st = os.stat(f"/run/netns/{netns}")
    except OSError:
        return []
    want = f"net:[{st.st_ino}]"
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if os.readlink(entry / "ns" / "net") == want and _alive(int(entry.name)):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _kill_all(pids: Sequence[int], sig: int, grace: float) -> None:
    """Send ``sig`` to each PID; after ``grace`` seconds SIGKILL the ones still alive."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    if sig == signal.SIGKILL:
        return
    deadline = time.monotonic() + grace
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _alive(p)]
    for pid in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _rewrite_etc_hosts(tag: str, block: str) -> None:
    """Replace this instance's block in /etc/hosts (``""`` removes it); keeps the file's inode."""
    begin, end = f"# BEGIN horovod fakehosts {tag}", f"# END horovod fakehosts {tag}"
    try:
        old = ETC_HOSTS.read_text()
    except OSError:
        return
    kept, skip = [], False
    for line in old.splitlines():
        if line == begin:
            skip = True
        elif line == end:
            skip = False
        elif not skip:
            kept.append(line)
    new = "\n".join(kept) + "\n"
    if block:
        new += f"{begin}\n{block}{end}\n"
    if new != old:
        with open(ETC_HOSTS, "r+") as f:  # in place: /etc/hosts is often a bind mount
            f.write(new)
            f.truncate()


def _teardown(record: Mapping[str, Any]) -> None:
    """Remove everything the instance described by ``record`` made (idempotent)."""
    tag = record["tag"]
    namespaces = record["namespaces"]
    for ns in namespaces:  # sshd, ssh sessions, test workers
        _kill_all(_netns_pids(ns), signal.SIGTERM, grace=2.0)
    for ns in namespaces:
        left = _netns_pids(ns)
        _kill_all(left, signal.SIGKILL, grace=0)
    for veth in record["veths"]:
        _sh(["ip", "link", "del", veth], check=False)
    for ns in namespaces:
        _sh(["ip", "netns", "del", ns], check=False)
    _sh(["ip", "link", "del", record["bridge"]], check=False)
    with contextlib.suppress(OSError):
        Path(record["ssh_dropin"]).unlink()
    _rewrite_etc_hosts(tag, "")
    shutil.rmtree(record["state"], ignore_errors=True)


def _sweep_orphans() -> None:
    """Tear down instances whose owner process is gone (a test run killed before close)."""
    if not RUN_DIR.is_dir():
        return
    for rec_file in RUN_DIR.glob("*/record.json"):
        try:
            record = json.loads(rec_file.read_text())
        except (OSError, ValueError):
            continue
        if _proc_start(record["owner"]) == record["owner_start"]:
            continue
        _teardown(record)


def _used_subnets() -> set[int]:
    used = set()
    out = _sh(["ip", "-o", "-4", "addr", "show"], check=False).stdout
    for word in out.split():
        if word.startswith(NET_BASE + "."):
            with contextlib.suppress(ValueError, IndexError):
                used.add(int(word.split(".")[2]))
    if RUN_DIR.is_dir():
        for d in RUN_DIR.iterdir():
            if d.name.startswith("hf") and d.name[2:].isdigit():
                used.add(int(d.name[2:]))
    return used


class FakeHosts:
    """``n`` hosts, each a network namespace with its own address, host name and sshd.

    ``prefix`` names the hosts ``{prefix}1..{prefix}n``; by default it is unique to the instance
    (``fh<k>-host``), so that several instances can live at once. ``remote_path``, when given,
    is the PATH of every ssh session (by default sshd's stock PATH, as on a real cluster).
    """

    def __init__(self, n: int, prefix: str | None = None, *, remote_path: str | None = None):
        if not 1 <= n <= MAX_HOSTS:
            raise ValueError(f"FakeHosts: n must be between 1 and {MAX_HOSTS}, got {n}")
        reason = unavailable_reason()
        if reason:
            raise FakeHostsError(reason)
        self._closed = False
        self._record: dict[str, Any] | None = None
        with _locked():
            _sweep_orphans()
            used = _used_subnets()
            # The next free /24 after the last one handed out: no address is reused at once.
            last_file = RUN_DIR / "last"
            try:
                last = int(last_file.read_text())
            except (OSError, ValueError):
                last = 0
            free = [k for k in [*range(last + 1, 250), *range(1, last + 1)] if k not in used]
            if not free:
                raise FakeHostsError(f"no free /24 left in {NET_BASE}.0.0/16 for fake hosts")
            k = free[0]
            RUN_DIR.mkdir(parents=True, exist_ok=True)
            last_file.write_text(str(k))
            tag = f"hf{k}"
            prefix = prefix or f"fh{k}-host"
            names = [f"{prefix}{i}" for i in range(1, n + 1)]
            taken = _etc_hosts_names()
            clash = [h for h in names if h in taken]
            if clash:
                raise FakeHostsError(f"host name(s) {', '.join(clash)} already in /etc/hosts; "
                                     "choose another prefix")
            state = RUN_DIR / tag
            state.mkdir(parents=True, exist_ok=False)
            state.chmod(0o700)
            self.tag = tag
            self.subnet = f"{NET_BASE}.{k}.0/24"
            self.gateway = f"{NET_BASE}.{k}.254"
            self.hosts: list[str] = names
            self._addr = {h: f"{NET_BASE}.{k}.{i}" for i, h in enumerate(names, 1)}
            self._ns = {h: f"{tag}n{i}" for i, h in enumerate(names, 1)}
            self._state = state
            self._record = {
                "tag": tag, "owner": os.getpid(), "owner_start": _proc_start(os.getpid()),
                "namespaces": list(self._ns.values()),
                "veths": [f"{tag}v{i}" for i in range(1, n + 1)],
                "bridge": f"{tag}br", "state": str(state),
                "ssh_dropin": str(SSH_DROPIN_DIR / f"horovod-fakehosts-{tag}.conf"),
                "hosts": names,
            }
            (state / "record.json").write_text(json.dumps(self._record))
            atexit.register(self.close)
            try:
                self._up(remote_path)
            except BaseException:
                self._close_locked()
                raise
        self._wait_for_ssh()

    # ------------------------------------------------------------------ bring-up --
    def _up(self, remote_path: str | None) -> None:
        rec, state = self._record, self._state
        assert rec is not None
        br = rec["bridge"]
        _sh(["ip", "link", "add", br, "type", "bridge"])
        _sh(["sysctl", "-qw", f"net.ipv6.conf.{br}.disable_ipv6=1"], check=False)
        _sh(["ip", "addr", "add", f"{self.gateway}/24", "dev", br])
        _sh(["ip", "link", "set", br, "up"])
        _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"horovod-fakehosts-{self.tag}",
             "-f", str(state / "id_ed25519")])
        shutil.copy(state / "id_ed25519.pub", state / "authorized_keys")
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        known = []
        for i, host in enumerate(self.hosts, 1):
            ns, veth, addr = self._ns[host], rec["veths"][i - 1], self._addr[host]
            _sh(["ip", "netns", "add", ns])
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            _sh(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _sh(["sysctl", "-qw", f"net.ipv6.conf.{veth}.disable_ipv6=1"], check=False)
            _sh(["ip", "link", "set", veth, "master", br, "up"])
            _sh(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0"])
            _sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
            hdir = state / host
            hdir.mkdir()
            key = hdir / "ssh_host_ed25519_key"
            _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", host, "-f", str(key)])
            conf = [f"ListenAddress {addr}:22", f"HostKey {key}", f"PidFile {hdir / 'sshd.pid'}",
                    f"AuthorizedKeysFile {state / 'authorized_keys'}",
                    "PermitRootLogin prohibit-password", "PubkeyAuthentication yes",
                    "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
                    "StrictModes no", "UseDNS no", "MaxStartups 200", "MaxSessions 200",
                    "PrintMotd no", "PrintLastLog no", "X11Forwarding no", "LogLevel INFO",
                    "AcceptEnv LANG LC_*"]
            if remote_path:
                conf.append(f"SetEnv PATH={remote_path}")
            (hdir / "sshd_config").write_text("\n".join(conf) + "\n")
            _sh(self._wrap(host, [SSHD, "-f", str(hdir / "sshd_config"),
                                  "-E", str(hdir / "sshd.log")]))
            pubkey = " ".join(Path(f"{key}.pub").read_text().split()[:2])
            known.append(f"{host},{addr} {pubkey}")
        (state / "known_hosts").write_text("\n".join(known) + "\n")
        names = " ".join(self.hosts + [self._addr[h] for h in self.hosts])
        dropin = "\n".join([
            f"# made by tests/_fakehosts.py ({self.tag}); removed at close",
            f"Host {names}", "    User root", "    Port 22",
            f"    IdentityFile {state / 'id_ed25519'}", "    IdentitiesOnly yes",
            f"    UserKnownHostsFile {state / 'known_hosts'}", "    GlobalKnownHostsFile /dev/null",
            "    StrictHostKeyChecking no", "    CheckHostIP no", "    BatchMode yes",
            "    PasswordAuthentication no", "    ConnectTimeout 10", "    LogLevel ERROR", ""])
        SSH_DROPIN_DIR.mkdir(parents=True, exist_ok=True)
        Path(rec["ssh_dropin"]).write_text(dropin)
        Path(rec["ssh_dropin"]).chmod(0o644)
        _rewrite_etc_hosts(self.tag, "".join(f"{self._addr[h]} {h}\n" for h in self.hosts))

    def _wait_for_ssh(self) -> None:
        """Every sshd answers a key login with its own host name (from the machine)."""
        for host in self.hosts:
            deadline, last = time.monotonic() + 60, ""
            while True:
                try:
                    res = subprocess.run(["ssh", "-o", "ConnectTimeout=2", host, "hostname"],
                                         capture_output=True, text=True, timeout=30)
                    if res.returncode == 0 and res.stdout.strip() == host:
                        break
                    last = (res.stderr or res.stdout).strip()
                except subprocess.TimeoutExpired:
                    last = ("logged in but `hostname` gave no answer in 30 s (does the login "
                            "shell's startup file hang?)")
                if time.monotonic() > deadline:
                    log = self._state / host / "sshd.log"
                    tail = log.read_text()[-500:] if log.exists() else ""
                    self.close()
                    raise FakeHostsError(f"ssh to fake host {host} failed: {last}\nsshd log: {tail}")
                time.sleep(0.1)

    # ------------------------------------------------------------------- use --
    def address(self, host: str) -> str:
        """The host's address on the private bridge."""
        return self._addr[self._check(host)]

    def netns(self, host: str) -> str:
        """The name of the host's network namespace (for ``ip netns exec``)."""
        return self._ns[self._check(host)]

    def _check(self, host: str) -> str:
        if host not in self._addr:
            raise KeyError(f"{host!r} is not one of these fake hosts: {', '.join(self.hosts)}")
        if self._closed:
            raise FakeHostsError(f"fake hosts {self.tag} are closed")
        return host

    def _wrap(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``: its network namespace and a UTS namespace named for it."""
        # Each step execs the next, so the returned process is ``argv`` itself.
        return ["ip", "netns", "exec", self._ns[host], "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', host, *argv]

    def popen(self, host: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``host`` (``env`` adds to this process's environment)."""
        full_env = dict(os.environ, **env) if env is not None else None
        return subprocess.Popen(self._wrap(self._check(host), argv), env=full_env, **kwargs)

    def run(self, host: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
            timeout: float = 120, cwd: str | os.PathLike[str] | None = None,
            check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside ``host`` to completion; captured, decoded stdout and stderr."""
        full_env = dict(os.environ, **env) if env is not None else None
        res = subprocess.run(self._wrap(self._check(host), argv), env=full_env, cwd=cwd,
                             capture_output=True, timeout=timeout, check=False)
        out = subprocess.CompletedProcess(list(argv), res.returncode,
                                          res.stdout.decode(errors="replace"),
                                          res.stderr.decode(errors="replace"))
        if check:
            out.check_returncode()
        return out

    def host_pids(self, host: str) -> list[int]:
        """Every process running inside ``host`` (its sshd included)."""
        return _netns_pids(self._ns[self._check(host)])

    def kill_host_processes(self, host: str, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process inside ``host`` (as if the host died); their PIDs."""
        pids = self.host_pids(host)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        return pids

    # ------------------------------------------------------------------ close --
    def close(self) -> None:
        """Kill everything inside the hosts and remove every namespace, link and file made."""
        if self._closed or self._record is None:
            return
        with _locked():
            self._close_locked()

    def _close_locked(self) -> None:
        self._closed = True
        atexit.unregister(self.close)
        if self._record is not None:
            _teardown(self._record)

    def __enter__(self) -> FakeHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        hosts = ", ".join(f"{h}={self._addr[h]}" for h in self.hosts)
        return f"FakeHosts({self.tag}: {hosts}{', closed' if self._closed else ''})"


def _etc_hosts_names() -> set[str]:
    try:
        text = ETC_HOSTS.read_text()
    except OSError:
        return set()
    return {w for line in text.splitlines() if not line.lstrip().startswith("#")
            for w in line.split()[1:]}
