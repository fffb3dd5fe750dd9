"""The Slurm fixture (``tests/_slurm.py``) runs its own daemons on ports of its own and talks to no other Slurm.

A decoy holds Slurm's default ports (6817/6818) as another Slurm of the machine would; a second
fixture's cluster holds the ports of another; the suite's cluster and a new one still answer as
themselves, and a fixture told to use a port someone else holds refuses at once, naming the holder.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests import _slurm
from tests._slurm import DEFAULT_PORTS, SlurmCluster, SlurmError, port_owners

pytestmark = [pytest.mark.integration, pytest.mark.slurm]

_LISTEN = """
import socket, sys, time
socks = []
for port in map(int, sys.argv[1:]):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", port)); s.listen(16); socks.append(s)
    except OSError:  # already held by someone else: a decoy all the same
        s.close()
print("LISTENING", " ".join(str(s.getsockname()[1]) for s in socks), flush=True)
time.sleep(600)  # accepts nothing, answers nothing: a client sent here waits
"""


@pytest.fixture
def decoy() -> Iterator:
    """Start a process that listens on the given ports and never answers; yields (start, pid)."""
    procs: list[subprocess.Popen[str]] = []

    def start(*ports: int) -> tuple[int, list[int]]:
        proc = subprocess.Popen([sys.executable, "-c", _LISTEN, *map(str, ports)], stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("LISTENING"), line
        return proc.pid, [int(p) for p in line.split()[1:]]

    try:
        yield start
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _cluster_seen_by_a_job(cluster: SlurmCluster) -> set[str]:
    env = dict({k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, **cluster.env())
    res = subprocess.run(["srun", "-n", "2", "printenv", "SLURM_CLUSTER_NAME"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res
    return set(res.stdout.split())


def test_clusters_use_their_own_daemons_beside_a_decoy_on_the_default_ports(slurm, decoy):
    """With a decoy on 6817/6818 (or whatever already listens there), the suite's cluster and a second
    one made now each answer on their own ports, from the daemons they started, with their own name."""
    decoy(*DEFAULT_PORTS)
    second = SlurmCluster().acquire()
    try:
        for cluster in (slurm, second):
            ports = (cluster.ctld_port, cluster.slurmd_port)
            assert not set(ports) & set(DEFAULT_PORTS), ports
            assert set(port_owners(cluster.ctld_port)) == {cluster.pids["slurmctld"]}
            assert set(port_owners(cluster.slurmd_port)) == {cluster.pids["slurmd"]}
            cluster.verify()  # scontrol show config / show slurmd: this cluster's name, ports, pids
            assert _cluster_seen_by_a_job(cluster) == {cluster.name}
        assert second.name != slurm.name and not {second.ctld_port, second.slurmd_port} & {slurm.ctld_port,
                                                                                           slurm.slurmd_port}
    finally:
        second.release()
    assert not second.dir.exists() and not second.pids
    assert _cluster_seen_by_a_job(slurm) == {slurm.name}  # the suite's cluster outlives the second


def test_a_port_another_process_holds_is_refused_at_once(slurm, decoy):
    """Told to use a port the decoy (or the suite's own slurmd) listens on, the fixture refuses before it
    starts anything, naming the process that holds it."""
    pid, (port,) = decoy(0)
    for taken, holder in ((port, pid), (slurm.slurmd_port, slurm.pids["slurmd"])):
        cluster = SlurmCluster(ports=(taken, _slurm._free_port()))
        t0 = time.monotonic()
        with pytest.raises(SlurmError, match=rf"port {taken} .* already listened on by pid {holder} "):
            cluster.acquire()
        assert time.monotonic() - t0 < 20
        assert not cluster.dir.exists() and not cluster.pids


def test_a_port_taken_while_the_daemons_start_fails_naming_the_holder(slurm, decoy, monkeypatch):
    """The port is free when checked but another process listens on it before slurmctld binds (the race
    a free-port pick leaves): ``acquire()`` fails fast, naming that process, instead of using the
    controller that answers there."""
    pid, (port,) = decoy(0)
    real = _slurm.port_owners
    calls: list[int] = []

    def owners(p: int) -> dict[int, str]:
        calls.append(p)
        return {} if len(calls) <= 2 else real(p)  # the two checks before the start see the ports free

    monkeypatch.setattr(_slurm, "port_owners", owners)
    cluster = SlurmCluster(ports=(port, _slurm._free_port()))
    t0 = time.monotonic()
    with pytest.raises(SlurmError, match=rf"port {port}\b.*pid {pid} ") as err:
        cluster.acquire()
    assert time.monotonic() - t0 < 20
    assert "already listened on" not in str(err.value) and len(calls) > 2, err.value
    assert not cluster.dir.exists() and not cluster.pids
