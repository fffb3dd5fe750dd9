"""Multi-host launching on real separate hosts: network namespaces made by shared/tools/fakehosts.

Each fake host has its own address, host name and sshd; horovodrun runs inside fakehost1 and
reaches fakehost2 over ssh (Gloo) or through mpirun (MPI), exactly as across two machines.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import REPO, WORKER, launcher_env, tagged_json

pytestmark = [pytest.mark.integration, pytest.mark.fakehosts]

FAKEHOSTS = Path(os.environ.get("HVD_FAKEHOSTS", REPO.parent / "shared" / "tools" / "fakehosts"))
HOSTS = "fakehost1:2,fakehost2:2"


def _namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None and shutil.which("apt-get") is None:
        return "neither iproute2 nor apt-get is available"
    if shutil.which("ip") is None:
        return None  # fakehosts installs iproute2 itself
    probe = f"hvdprobe{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        return f"cannot create a network namespace: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


@pytest.fixture(scope="module")
def fakehosts():
    if not FAKEHOSTS.exists():
        pytest.fail(f"fakehosts tool not found at {FAKEHOSTS} (set HVD_FAKEHOSTS)")
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    up = subprocess.run([str(FAKEHOSTS), "up", "2"], capture_output=True, text=True, timeout=600)
    try:
        assert up.returncode == 0, f"fakehosts up 2 failed:\n{up.stdout}\n{up.stderr}"
        yield FAKEHOSTS
    finally:
        subprocess.run([str(FAKEHOSTS), "down", "--kill-stragglers"], capture_output=True,
                       timeout=120)


def run_on_fakehost1(fh: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run horovodrun inside fakehost1 (the launcher's host)."""
    env = launcher_env()
    passed = [f"{k}={env[k]}" for k in ("PYTHONPATH", "OMPI_ALLOW_RUN_AS_ROOT",
                                         "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "PATH")]
    argv = [str(fh), "exec", "fakehost1", "env", *passed, sys.executable, "-m", "horovod.runner",
            *args]
    res = subprocess.run(argv, capture_output=True, timeout=timeout, cwd=str(REPO), env=env)
    return subprocess.CompletedProcess(argv, res.returncode, res.stdout.decode(errors="replace"),
                                       res.stderr.decode(errors="replace"))


@pytest.mark.parametrize("mode", ["mpi", "gloo"])
def test_allreduce_across_two_hosts(fakehosts: Path, mode: str) -> None:
    res = run_on_fakehost1(fakehosts, f"--{mode}", "-np", "4", "-H", HOSTS, sys.executable, WORKER,
                           "allreduce")
    assert res.returncode == 0, res.stdout + res.stderr
    results = tagged_json(res.stdout, "RESULT")
    assert sorted(results) == [0, 1, 2, 3], res.stdout + res.stderr
    want_sum = [0 + 1 + 2 + 3 + 4 * i for i in range(4)]
    for r, got in results.items():
        case = f"rank {r} ({mode})"
        host = "fakehost1" if r < 2 else "fakehost2"
        assert got["host"] == host, f"{case}: ran on {got['host']}, expected {host}"
        assert got["sum"] == want_sum, f"{case}: allreduce -> {got['sum']}, expected {want_sum}"
        assert (got["size"], got["local_size"], got["cross_size"]) == (4, 2, 2), case
        assert got["local_rank"] == r % 2, f"{case}: local_rank {got['local_rank']}"
        assert got["cross_rank"] == r // 2, f"{case}: cross_rank {got['cross_rank']}"


@pytest.mark.parametrize("mode", ["mpi", "gloo"])
def test_worker_killed_on_second_host_ends_job_with_report(fakehosts: Path, mode: str) -> None:
    start = time.monotonic()
    res = run_on_fakehost1(fakehosts, f"--{mode}", "-np", "4", "-H", HOSTS, sys.executable, WORKER,
                           "kill", "2", timeout=120)
    elapsed = time.monotonic() - start
    report = res.stderr
    assert res.returncode == 137, report
    assert "rank 2 (host fakehost2, local rank 0): killed by signal 9 (SIGKILL)" in report, report
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


def test_gloo_rendezvous_refuses_strangers_across_hosts(fakehosts: Path) -> None:
    """A process on fakehost2 without the job's secret gets nothing from the launcher's service."""
    script = (
        "import sys, time\n"
        "from horovod.runner.rendezvous import RendezvousServer, RendezvousClient, make_secret\n"
        "from horovod.runner.rendezvous.auth import RendezvousError\n"
        "srv = RendezvousServer(make_secret(), host='10.200.0.1')\n"
        "srv.put('s', 'k', b'payload')\n"
        "print(srv.port, flush=True)\n"
        "sys.stdin.readline()\n"
        "print('rejected', srv.rejected, flush=True)\n"
    )
    env = launcher_env()
    server = subprocess.Popen([str(fakehosts), "exec", "fakehost1", "env", f"PYTHONPATH={env['PYTHONPATH']}",
                               sys.executable, "-c", script], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=str(REPO))
    try:
        assert server.stdout is not None and server.stdin is not None
        port = int(server.stdout.readline())
        probe = ("from horovod.runner.rendezvous import RendezvousClient, make_secret\n"
                 f"c = RendezvousClient('10.200.0.1', {port}, make_secret(), timeout=10)\n"
                 "try:\n    c.get('s', 'k')\nexcept Exception as e:\n    print('REFUSED', e)\n"
                 "else:\n    print('LEAKED')\n")
        res = subprocess.run([str(fakehosts), "exec", "fakehost2", "env",
                              f"PYTHONPATH={env['PYTHONPATH']}", sys.executable, "-c", probe],
                             capture_output=True, text=True, timeout=60, cwd=str(REPO))
        assert "REFUSED" in res.stdout and "refused this worker" in res.stdout, res.stdout + res.stderr
        server.stdin.write("\n")
        server.stdin.flush()
        assert server.stdout.readline().strip() == "rejected 1"
    finally:
        server.kill()
        server.wait(10)
