"""A late rank joins a running ``horovodrun --gloo`` job while an outsider floods every port the
job listens on (the launcher's rendezvous service, rank 0's store, and anything else in the
socket table) with thousands of idle and trickling connections, or streams large unsigned
bodies at the launcher; loopback only, bounded."""

from __future__ import annotations

import re
import resource
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tests.launchers.test_store_auth import BIN, _env, listening_ports
from tests.unit.runner.test_rendezvous_hostile import MiB, _stream

pytestmark = pytest.mark.integration

JOB = BIN / "late_rank_job.py"
LINE = re.compile(r"LATE rank (\d) size (\d) sum (\S+) ok (\w+)")
PER_PORT = 3000


def _flood(ports: list[int], stop: threading.Event, socks: list[socket.socket]) -> None:
    for port in ports:
        for _ in range(PER_PORT):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            socks.append(s)
    while not stop.wait(2.0):  # every other connection trickles a byte every 2 s
        for s in socks[::2]:
            try:
                s.send(b"H")
            except OSError:
                pass


@pytest.fixture
def many_fds():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 6 * PER_PORT + 1024
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"needs {want} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_late_rank_joins_while_every_port_is_flooded(tmp_path, many_fds) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "horovod.runner", "--gloo", "-np", "2",
                             sys.executable, str(JOB)], env=_env({"PROBE_DIR": str(tmp_path)}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stop, socks = threading.Event(), []
    flooder = threading.Thread()
    try:
        # Rank 0 is in hvd.init() once its store listens; rank 1 waits for "go".
        ports = _wait_for_rank0(proc)
        targets = sorted({p for _, p, _ in ports})
        flooder = threading.Thread(target=_flood, args=(targets, stop, socks), daemon=True)
        flooder.start()
        while len(socks) < PER_PORT * len(targets) and flooder.is_alive():
            time.sleep(0.1)
        (tmp_path / "go").write_text("1")  # the late rank starts while the flood is held
        try:
            out = proc.communicate(timeout=240)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"job did not finish:\n{proc.communicate()[0][-4000:]}") from None
    finally:
        stop.set()
        if flooder.ident is not None:
            flooder.join(timeout=30)
        for s in socks:
            s.close()
        if proc.poll() is None:
            proc.kill()
    print(f"flooded ports {targets} with {len(socks)} connections")
    assert proc.returncode == 0, out[-4000:]
    lines = sorted(LINE.findall(out))
    assert [(int(r), int(n), float(s), ok) for r, n, s, ok in lines] == [
        (0, 2, 3.0, "True"), (1, 2, 3.0, "True")], out[-4000:]


def _wait_for_rank0(proc: subprocess.Popen) -> list[tuple[str, int, int]]:
    """The job's listening sockets once rank 0 listens too (it is then in ``hvd.init()``)."""
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        ports = listening_ports(proc.pid)
        if any(pid != proc.pid for _, _, pid in ports):
            return ports
        assert time.monotonic() < deadline, f"rank 0 never listened: {ports}"
        time.sleep(0.2)


def test_unsigned_bodies_do_not_grow_horovodrun(tmp_path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "horovod.runner", "--gloo", "-np", "2",
                             sys.executable, str(JOB)], env=_env({"PROBE_DIR": str(tmp_path)}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ports = _wait_for_rank0(proc)
        [port] = [p for _, p, pid in ports if pid == proc.pid]  # the launcher's rendezvous
        launcher = psutil.Process(proc.pid)
        base = peak = launcher.memory_info().rss
        total = 200 * MiB
        heads = [f"PUT /kv/gloo/x HTTP/1.1\r\nContent-Length: {total}\r\n"
                 f"X-Horovod-Auth: {time.time():.6f}:abcd:{'0' * 64}\r\n\r\n".encode(),
                 f"PUT /kv/runfunc_result/0 HTTP/1.1\r\nContent-Length: {total}\r\n\r\n".encode()]
        sent: list[int] = []
        streams = [threading.Thread(target=_stream, args=(port, heads[i % 2], total, sent),
                                    daemon=True) for i in range(4)]
        for t in streams:
            t.start()
        while any(t.is_alive() for t in streams):
            peak = max(peak, launcher.memory_info().rss)
            time.sleep(0.05)
        peak = max(peak, launcher.memory_info().rss)
        (tmp_path / "go").write_text("1")
        try:
            out = proc.communicate(timeout=240)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"job did not finish:\n{proc.communicate()[0][-4000:]}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
    growth = (peak - base) / MiB
    print(f"horovodrun RSS {base / MiB:.1f} -> peak {peak / MiB:.1f} MiB (+{growth:.1f} MiB) while "
          f"4 streams sent {[n // MiB for n in sent]} MiB of their 200 MiB")
    assert growth < 100, growth
    assert proc.returncode == 0, out[-4000:]
    lines = sorted(LINE.findall(out))
    assert [(int(r), int(n), float(s), ok) for r, n, s, ok in lines] == [
        (0, 2, 3.0, "True"), (1, 2, 3.0, "True")], out[-4000:]
