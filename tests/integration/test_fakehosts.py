"""Multi-host launching on real separate hosts made by ``tests/_fakehosts.py``.

Each fake host is a network namespace with its own address, host name and sshd; horovodrun runs
inside the first host and reaches the second over ssh (Gloo) or through mpirun (MPI), exactly as
across two machines. The first tests check the fixture itself.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests._fakehosts import ETC_HOSTS, SSH_DROPIN_DIR, FakeHosts
from tests.integration.conftest import REPO, WORKER, launcher_env, tagged_json

pytestmark = [pytest.mark.integration, pytest.mark.fakehosts]

Factory = Callable[..., FakeHosts]


def test_hosts_reach_each_other_by_name_over_ssh(fakehosts_factory: Factory) -> None:
    fh = fakehosts_factory(3)
    assert len(set(fh.hosts)) == 3 and len({fh.address(h) for h in fh.hosts}) == 3
    for src in fh.hosts:
        assert fh.run(src, ["hostname"]).stdout.strip() == src
        for dst in fh.hosts:
            res = fh.run(src, ["ssh", dst, "hostname; ip -4 -o addr show dev eth0"], timeout=60)
            assert res.returncode == 0, f"ssh {src} -> {dst}: {res.stderr}"
            name, addr_line = res.stdout.splitlines()[:2]
            assert name == dst and f"inet {fh.address(dst)}/24" in addr_line, res.stdout
    # from the machine itself, by name, without a password
    res = subprocess.run(["ssh", fh.hosts[1], "hostname"], capture_output=True, text=True,
                         timeout=60)
    assert res.stdout.strip() == fh.hosts[1], res.stderr
    # a host reaches nothing but the private bridge: no default route
    routes = fh.run(fh.hosts[0], ["ip", "-4", "route"]).stdout
    assert "default" not in routes and routes.count("\n") == 1, routes


def test_two_instances_at_once_are_separate(fakehosts_factory: Factory) -> None:
    a, b = fakehosts_factory(2), fakehosts_factory(2)
    assert not set(a.hosts) & set(b.hosts)
    assert a.subnet != b.subnet
    assert fh_hostname(b, b.hosts[0]) == b.hosts[0]
    res = a.run(a.hosts[0], ["ssh", "-o", "ConnectTimeout=2", b.address(b.hosts[0]), "true"],
                timeout=60)
    assert res.returncode != 0, "a host of one instance reached a host of another"


def fh_hostname(fh: FakeHosts, host: str) -> str:
    return fh.run(host, ["ssh", host, "hostname"], timeout=60).stdout.strip()


def test_kill_host_processes_and_close_leave_nothing(fakehosts_factory: Factory) -> None:
    fh = fakehosts_factory(2)
    h1, h2 = fh.hosts
    sleeper = fh.popen(h2, ["sleep", "300"])
    remote = fh.popen(h1, ["ssh", h2, "sleep 301"])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        # the remote command itself, once the login shell's startup files are done
        cmds = [Path(f"/proc/{p}/cmdline").read_bytes() for p in fh.host_pids(h2)
                if Path(f"/proc/{p}/cmdline").exists()]
        if b"sleep\x00301\x00" in cmds:
            break
        time.sleep(0.1)
    killed = fh.kill_host_processes(h2, signal.SIGKILL)
    assert sleeper.pid in killed
    assert sleeper.wait(10) == -signal.SIGKILL
    assert remote.wait(30) != 0  # its sshd died with the host
    assert fh.host_pids(h2) == []
    assert fh.run(h1, ["ssh", "-o", "ConnectTimeout=2", h2, "true"], timeout=60).returncode != 0
    survivor = fh.popen(h1, ["sleep", "300"])
    namespaces = [fh.netns(h) for h in fh.hosts]
    fh.close()
    assert survivor.wait(10) != 0, "close() left a process running inside a host"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces), listed
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert fh.tag not in links, links
    assert h1 not in ETC_HOSTS.read_text()
    assert not list(SSH_DROPIN_DIR.glob(f"*{fh.tag}*"))


def test_close_after_a_failing_body_removes_everything() -> None:
    from tests._fakehosts import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with pytest.raises(ZeroDivisionError):
        with FakeHosts(1) as fh:
            fh.popen(fh.hosts[0], ["sleep", "300"])
            _ = 1 / 0
    assert fh.hosts[0] not in ETC_HOSTS.read_text()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert fh.tag not in listed, listed
    assert not list(SSH_DROPIN_DIR.glob(f"*{fh.tag}*"))


def run_horovodrun_on(fh: FakeHosts, host: str, *args: str,
                      timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run horovodrun inside ``host`` (the launcher's host)."""
    env = launcher_env()
    return fh.run(host, [sys.executable, "-m", "horovod.runner", *args], env=env,
                  timeout=timeout, cwd=str(REPO))


@pytest.mark.parametrize("mode", ["mpi", "gloo"])
def test_allreduce_across_two_hosts(fakehosts_factory: Factory, mode: str) -> None:
    fh = fakehosts_factory(2)
    h1, h2 = fh.hosts
    res = run_horovodrun_on(fh, h1, f"--{mode}", "-np", "4", "-H", f"{h1}:2,{h2}:2",
                            sys.executable, WORKER, "allreduce")
    assert res.returncode == 0, res.stdout + res.stderr
    results = tagged_json(res.stdout, "RESULT")
    assert sorted(results) == [0, 1, 2, 3], res.stdout + res.stderr
    want_sum = [0 + 1 + 2 + 3 + 4 * i for i in range(4)]
    for r, got in results.items():
        case = f"rank {r} ({mode})"
        host = h1 if r < 2 else h2
        assert got["host"] == host, f"{case}: ran on {got['host']}, expected {host}"
        assert got["sum"] == want_sum, f"{case}: allreduce -> {got['sum']}, expected {want_sum}"
        assert (got["size"], got["local_size"], got["cross_size"]) == (4, 2, 2), case
        assert got["local_rank"] == r % 2, f"{case}: local_rank {got['local_rank']}"
        assert got["cross_rank"] == r // 2, f"{case}: cross_rank {got['cross_rank']}"


@pytest.mark.parametrize("mode", ["mpi", "gloo"])
def test_worker_killed_on_second_host_ends_job_with_report(fakehosts_factory: Factory,
                                                           mode: str, tmp_path: Path) -> None:
    fh = fakehosts_factory(2)
    h1, h2 = fh.hosts
    start = time.monotonic()
    res = run_horovodrun_on(fh, h1, f"--{mode}", "-np", "4", "-H", f"{h1}:2,{h2}:2",
                            sys.executable, WORKER, "kill", "2", str(tmp_path), timeout=120)
    elapsed = time.monotonic() - start
    report = res.stderr
    assert res.returncode == 137, report
    assert f"rank 2 (host {h2}, local rank 0): killed by signal 9 (SIGKILL)" in report, report
    assert "| rank 2 is failing on purpose" in report, report
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end after rank 2 was killed"
    grandchildren = [int(p) for p in re.findall(r"GRANDCHILD (\d+)", res.stdout)]
    assert len(grandchildren) == 3, res.stdout
    deadline = time.monotonic() + 10  # the hosts share one PID namespace: we can look
    alive = grandchildren
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if Path(f"/proc/{p}").exists()
                 and Path(f"/proc/{p}/stat").read_text().split(")")[-1].split()[0] != "Z"]
        time.sleep(0.2)
    assert not alive, f"processes left running on the hosts: {alive}"


def test_gloo_rendezvous_refuses_strangers_across_hosts(fakehosts_factory: Factory) -> None:
    """A process on the second host without the job's secret gets nothing from the service."""
    fh = fakehosts_factory(2)
    h1, h2 = fh.hosts
    script = (
        "import sys, time\n"
        "from horovod.runner.rendezvous import RendezvousServer, RendezvousClient, RendezvousError, make_secret\n"
        f"srv = RendezvousServer(make_secret(), host={fh.address(h1)!r})\n"
        "srv.put('s', 'k', b'payload')\n"
        "print(srv.port, flush=True)\n"
        "sys.stdin.readline()\n"
        "print('rejected', srv.rejected, flush=True)\n"
    )
    env = launcher_env()
    server = fh.popen(h1, [sys.executable, "-c", script], env=env, stdin=subprocess.PIPE,
                      stdout=subprocess.PIPE, text=True, cwd=str(REPO))
    try:
        assert server.stdout is not None and server.stdin is not None
        port = int(server.stdout.readline())
        probe = ("from horovod.runner.rendezvous import RendezvousClient, make_secret\n"
                 f"c = RendezvousClient({fh.address(h1)!r}, {port}, make_secret(), timeout=10)\n"
                 "try:\n    c.get('s', 'k')\nexcept Exception as e:\n    print('REFUSED', e)\n"
                 "else:\n    print('LEAKED')\n")
        res = fh.run(h2, [sys.executable, "-c", probe], env=env, timeout=60, cwd=str(REPO))
        assert "REFUSED" in res.stdout and "refused this worker" in res.stdout, res.stdout + res.stderr
        server.stdin.write("\n")
        server.stdin.flush()
        assert server.stdout.readline().strip() == "rejected 1"
    finally:
        server.kill()
        server.wait(10)


@pytest.mark.parametrize("mode", ["mpi", "gloo"])
def test_exception_on_second_host_is_named_first(fakehosts_factory: Factory, mode: str) -> None:
    """Rank 2 (second host) raises while the others wait for it in an allreduce: the report
    names it and its error first, whatever order the ranks ended in."""
    fh = fakehosts_factory(2)
    h1, h2 = fh.hosts
    script = str(Path(WORKER).parent / "fail_at_step.py")
    start = time.monotonic()
    res = run_horovodrun_on(fh, h1, f"--{mode}", "-np", "4", "-H", f"{h1}:2,{h2}:2",
                            sys.executable, script, "raise", "outside", "2", timeout=120)
    elapsed = time.monotonic() - start
    assert res.returncode == 1, res.stderr[-3000:]
    lines = res.stderr.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith("Horovod detected"))
    assert lines[i + 1].startswith(f"  rank 2 (host {h2}, local rank 0): exit code 1"), res.stderr[-3000:]
    assert lines[i + 2] == "  error: RuntimeError: rank 2 fails on purpose", res.stderr[-3000:]
    assert elapsed < 60, f"the job took {elapsed:.0f} s"


def test_ssh_checks_host_keys_as_accept_new(fakehosts_factory: Factory) -> None:
    """ssh runs with StrictHostKeyChecking=accept-new: a host whose key differs from known_hosts
    is refused before anything starts (with what to do); a host not yet known is remembered."""
    fh = fakehosts_factory(2)
    h1, h2 = fh.hosts
    known = fh._state / "known_hosts"  # the instance's known_hosts (its ssh drop-in names it)
    original = known.read_text()
    other = fh._state / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    fake = " ".join(Path(f"{other}.pub").read_text().split()[:2])
    lines = original.splitlines()
    known.write_text("\n".join(f"{ln.split()[0]} {fake}" if ln.startswith(f"{h2},") else ln
                               for ln in lines) + "\n")
    args = ("--gloo", "-np", "2", "-H", f"{h1}:1,{h2}:1", sys.executable, WORKER, "allreduce")
    res = run_horovodrun_on(fh, h1, *args)
    assert res.returncode != 0, res.stdout + res.stderr
    assert "Host key verification failed" in res.stderr or "IDENTIFICATION HAS CHANGED" in res.stderr, res.stderr
    assert "--ssh-strict-host-key-checking" in res.stderr, res.stderr
    assert not tagged_json(res.stdout, "RESULT"), res.stdout
    # h2 unknown: accepted, and its key recorded.
    known.write_text("\n".join(ln for ln in lines if not ln.startswith(f"{h2},")) + "\n")
    res = run_horovodrun_on(fh, h1, *args)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(tagged_json(res.stdout, "RESULT")) == [0, 1], res.stdout
    host_key = " ".join(Path(fh._state / h2 / "ssh_host_ed25519_key.pub").read_text().split()[:2])
    found = subprocess.run(["ssh-keygen", "-F", h2, "-f", str(known)], capture_output=True, text=True)
    assert host_key in found.stdout, known.read_text()  # (hashed names: looked up with ssh-keygen -F)
