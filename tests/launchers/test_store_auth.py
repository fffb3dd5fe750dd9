"""No stranger in the job (issue 24): every store a running job listens on refuses outsiders.

Real jobs run, all four at once (Gloo np=2; the torch device plane's CPU twin; an elastic job
after a reset; plain ranks with a secret), while the test, as an outsider, finds every TCP port
the jobs' processes listen on in the socket table (psutil) and tries torch's ``TCPStore`` client
on each: read, write, delete, wait and count keys. Every attempt must fail, each job must finish
with the right values, and the refusal must be in the job's log. Unit tests of the store itself
are in tests/unit/common/test_authstore.py.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BIN = Path(__file__).resolve().parent / "bin"
JOB = BIN / "probed_job.py"
LINE = re.compile(r"PROBED rank (\d) size (\d) sum (\S+) ok (\w+)")


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "OMPI_COMM", "PMI"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"job ended before {path.name}:\n{proc.communicate()[0][-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {path.name} after {timeout} s:\n{proc.communicate()[0][-4000:]}")
        time.sleep(0.1)


def listening_ports(root_pid: int) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket listening in the job's process tree (the socket table)."""
    root = psutil.Process(root_pid)
    pids = {root_pid} | {p.pid for p in root.children(recursive=True)}
    return sorted({(c.laddr.ip, c.laddr.port, c.pid) for c in psutil.net_connections(kind="tcp")
                   if c.status == psutil.CONN_LISTEN and c.pid in pids})


def _attempt(addr: str, port: int, op: str) -> str:
    import torch.distributed as dist

    host = "127.0.0.1" if addr in ("0.0.0.0", "::") else addr
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=3),
                              wait_for_workers=False)
        if op == "read":
            store.get("store")
        elif op == "write":
            store.set("intruder", b"x")
        elif op == "delete":
            store.delete_key("store")
        elif op == "wait":
            store.wait(["store"], datetime.timedelta(seconds=2))
        else:
            store.num_keys()
    except Exception as exc:  # noqa: BLE001 - any failure is a refusal
        return f"refused ({type(exc).__name__})"
    return "ALLOWED"


def probe(ports: list[tuple[str, int, int]], deadline: float = 6.0) -> dict[tuple[str, int, str], str]:
    """Every operation on every port of ``ports`` (``listening_ports``), in parallel; one with no
    answer by ``deadline`` is refused too (a Gloo or HTTP listener may keep torch's client waiting
    for a reply that never comes; its thread ends when the job closes the socket). Such threads
    always run to the deadline, so it is kept short, and the module's jobs are probed together
    (``jobs``): an operation a store allows answers in well under a second (the deadline is
    counted from after torch's import, which the threads would otherwise wait for), and a refusal
    (torch's client retries within its 3 s connect timeout) in about 3-7 s on a loaded 2-core
    machine; a refusal that is later still counts as one, and the job's log must show it."""
    import torch.distributed  # noqa: F401 - imported before the deadline's clock starts

    jobs = [(a, p, op) for a, p, _ in ports for op in ("read", "write", "delete", "wait", "count")]
    results: dict[tuple[str, int, str], str] = {}

    def run(job: tuple[str, int, str]) -> None:
        results[job] = _attempt(*job)

    threads = [threading.Thread(target=run, args=(j,), daemon=True) for j in jobs]
    for t in threads:
        t.start()
    end = time.monotonic() + deadline
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    return {j: results.get(j, "refused (no answer)") for j in jobs}


def _finish(proc: subprocess.Popen, probe_dir: Path, np_: int) -> str:
    (probe_dir / "done").write_text("1")
    try:
        out = proc.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"job did not finish after the probe:\n{proc.communicate()[0][-4000:]}") from None
    assert proc.returncode == 0, out[-4000:]
    lines = sorted(LINE.findall(out))
    assert [(int(r), int(n), ok) for r, n, _, ok in lines] == [(r, np_, "True") for r in range(np_)], out[-4000:]
    return out


def _check(results: dict[tuple[str, int, str], str], out: str) -> None:
    allowed = [k for k, v in results.items() if v == "ALLOWED"]
    assert not allowed, f"outsider succeeded: {allowed}"
    refused = re.findall(r"store (\S+):(\d+) refused a connection from (\S+):", out)
    assert refused, out[-4000:]
    probed = {p for _, p, _ in results}
    for host, port, _ in refused:
        assert int(port) in probed
        assert host not in ("0.0.0.0", "::"), "the store listens on every interface"
    # logged once per peer address, not once per attempt
    assert len(refused) == len(set(refused)), refused


class Job:
    """One job of the module, probed with the others (``jobs``): what each test checks."""

    def __init__(self, name: str, np_: int, argv: list[str], env: dict[str, str], probe_dir: Path) -> None:
        self.name, self.np, self.probe_dir = name, np_, probe_dir
        self.proc = subprocess.Popen(argv, env=_env({"PROBE_DIR": str(probe_dir), **env}),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.error: BaseException | None = None  # what failed while it ran; its test raises it
        self.ports: list[tuple[str, int, int]] = []
        self.results: dict[tuple[str, int, str], str] = {}
        self.out = ""
        self.secret = ""
        self.port = 0  # the plain job's MASTER_PORT

    def step(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` unless an earlier step failed; keep its failure for this job's test."""
        if self.error is None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported by this job's test
                self.error = exc
                if self.proc.poll() is None:
                    self.proc.kill()

    def check(self) -> None:
        if self.error is not None:
            raise self.error


def _job_secret(job: Job) -> None:
    tree = psutil.Process(job.proc.pid).children(recursive=True)
    secrets = {p.environ().get("HOROVOD_SECRET_KEY") for p in tree} - {None}
    assert len(secrets) == 1, "the workers share one job secret"
    job.secret = secrets.pop()
    assert all(job.secret not in " ".join(p.cmdline()) for p in [psutil.Process(job.proc.pid), *tree]), "secret in ps"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Job]]:
    """The module's four jobs, started together and probed together (one probe deadline for all):
    Gloo np=2, the same with the torch device plane's CPU twin, an elastic job after a reset, and
    plain ranks (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT) with a secret."""
    import socket

    dirs = {name: tmp_path_factory.mktemp(name) for name in ("gloo", "twin", "elastic", "plain")}
    runner = [sys.executable, "-m", "horovod.runner"]
    out: dict[str, Job] = {
        "gloo": Job("gloo", 2, [*runner, "--gloo", "-np", "2", sys.executable, str(JOB)], {}, dirs["gloo"]),
        "twin": Job("twin", 2, [*runner, "--gloo", "-np", "2", sys.executable, str(JOB)],
                    {"HOROVOD_TORCH_CPU_PLANE": "1"}, dirs["twin"]),
    }
    hosts = dirs["elastic"] / "hosts"
    hosts.write_text("localhost:2\n")
    script = dirs["elastic"] / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    out["elastic"] = Job("elastic", 3, [*runner, "-np", "2", "--min-np", "2", "--max-np", "3",
                                        "--host-discovery-script", str(script), sys.executable, str(JOB)],
                         {"ELASTIC_TARGET": "3", "HOROVOD_GLOO_TIMEOUT_SECONDS": "20"}, dirs["elastic"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = f"{sys.executable} {JOB}"
    logs = dirs["plain"] / "rank"  # one file per rank: their lines do not interleave
    # each rank waited for by its pid: `wait -n` twice returns 127 when both exit together
    script_text = (f"RANK=0 {job} > {logs}0 2>&1 & p0=$!; RANK=1 {job} > {logs}1 2>&1 & p1=$!; "
                   f"wait $p0; r0=$?; wait $p1; r1=$?; cat {logs}0 {logs}1; exit $(( r0 | r1 ))")
    plain = out["plain"] = Job("plain", 2, ["bash", "-c", script_text],
                               {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                "HOROVOD_SECRET_KEY": "5e" * 32}, dirs["plain"])
    plain.port = port
    try:
        def grow() -> None:  # a new host: the elastic job resets and re-forms with 3 workers
            _wait_for(dirs["elastic"] / "started", out["elastic"].proc)
            tmp = dirs["elastic"] / "hosts.tmp"
            tmp.write_text("localhost:2\n127.0.0.1:1\n")
            os.replace(tmp, hosts)
        out["elastic"].step(grow)
        for j in out.values():
            j.step(lambda j=j: _wait_for(j.probe_dir / "ready", j.proc))
        for name in ("gloo", "twin"):
            out[name].step(lambda name=name: _job_secret(out[name]))

        def ports(j: Job) -> None:
            j.ports = listening_ports(j.proc.pid)
            assert j.ports, "the job listens on no port?"
        for j in out.values():
            j.step(lambda j=j: ports(j))
        probing = [j for j in out.values() if j.error is None]
        results = probe([p for j in probing for p in j.ports])
        for j in probing:
            mine = {(a, p) for a, p, _ in j.ports}
            j.results = {k: v for k, v in results.items() if (k[0], k[1]) in mine}

        def refused_at_handshake() -> None:
            # The store refuses a silent client at its handshake deadline: let that happen before the end.
            deadline = time.monotonic() + 120
            while f"store 127.0.0.1:{port} refused a connection" not in Path(f"{logs}0").read_text():
                assert time.monotonic() < deadline and plain.proc.poll() is None, Path(f"{logs}0").read_text()[-3000:]
                time.sleep(0.2)
        plain.step(refused_at_handshake)

        def finish(j: Job) -> None:
            j.out = _finish(j.proc, j.probe_dir, j.np)
        for j in out.values():
            j.step(lambda j=j: finish(j))
        yield out
    finally:
        for j in out.values():
            if j.proc.poll() is None:
                j.proc.kill()
                j.proc.communicate()


@pytest.mark.parametrize("twin", [False, True], ids=["gloo", "device-plane-twin"])
def test_running_gloo_job_refuses_outsiders(jobs: dict[str, Job], twin: bool) -> None:
    job = jobs["twin" if twin else "gloo"]
    job.check()
    _check(job.results, job.out)
    assert job.secret not in job.out, "secret in the job's output"
    stores = {int(p) for _, p, _ in re.findall(r"store (\S+):(\d+) refused a connection from (\S+):", job.out)}
    assert len(stores) == (2 if twin else 1), job.out[-3000:]  # the twin adds the device plane's store


def test_elastic_job_refuses_outsiders_after_a_reset(jobs: dict[str, Job]) -> None:
    job = jobs["elastic"]
    job.check()
    _check(job.results, job.out)


def test_plain_rank_environment_with_a_secret_opens_the_authenticated_store(jobs: dict[str, Job]) -> None:
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT with no torchrun agent, and HOROVOD_SECRET_KEY
    exported to every rank: rank 0 opens Horovod's authenticated store on MASTER_PORT (bound to
    MASTER_ADDR), not torch's TCPStore; outsiders are refused on every port, values stay right."""
    job = jobs["plain"]
    job.check()
    assert ("127.0.0.1", job.port) in {(a, p) for a, p, _ in job.ports}, "no store on MASTER_PORT"
    _check(job.results, job.out)
    assert "TCPStore" not in job.out, job.out[-3000:]  # no warning about an open store
