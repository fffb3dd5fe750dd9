"""``RayExecutor`` from a Ray Client process (``ray.init("ray://...")``), as upstream supports it:
the job's driver side runs in an actor on the cluster, results, callbacks and errors come back to
the client. The client is a separate process, connected through a Ray Client server (legacy
mode: one server process, serving one client) that the test starts for the shared cluster."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests._ports import reserved_port

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

CLIENT = r"""
import json, sys
import ray
ray.init(sys.argv[1])
from horovod.ray import RayExecutor
from horovod.ray.client import client_connected

def fn(scale):
    import os
    import torch
    import horovod.torch as hvd
    from horovod.ray import ray_logger
    hvd.init()
    ray_logger.log({"rank": hvd.rank(), "pid": os.getpid()})
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    return [hvd.rank(), hvd.size(), total * scale]

def boom():
    import horovod.torch as hvd
    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("boom on rank 1")
    return hvd.rank()

out = {"client": client_connected()}
ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2, cpus_per_worker=1)
ex.start()
seen = []
try:
    out["run"] = ex.run(fn, args=[10.0], callbacks=[seen.append])
    out["seen"] = seen
    out["single"] = ex.execute_single(lambda _: "rank0")
    out["remote"] = ray.get(ex.run_remote(lambda: 7))
    try:
        ex.run(boom)
    except Exception as e:
        out["error"] = [type(e).__name__, str(e)[:2000]]
finally:
    ex.shutdown()
print("RESULT " + json.dumps(out), flush=True)
"""


def _client_server(address: str) -> tuple[subprocess.Popen, int]:
    # The port stays reserved until the server listens on it (gRPC binds it with SO_REUSEADDR):
    # no other process takes it while the server starts, nor answers this readiness check.
    with reserved_port() as port:
        server = subprocess.Popen([sys.executable, "-m", "ray.util.client.server", "--mode", "legacy",
                                   "--host", "127.0.0.1", "--port", str(port), "--address", address],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120  # readiness only: the server starts slowly on a loaded machine
        while time.monotonic() < deadline and server.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return server, port
            except OSError:
                time.sleep(0.5)
    server.kill()
    pytest.fail(f"the Ray Client server did not start (exit code {server.poll()})")


def test_ray_client_mode_runs_the_job_from_outside(free_cluster):
    server, port = _client_server(free_cluster.cluster.address)
    try:
        res = subprocess.run([sys.executable, "-c", CLIENT, f"ray://127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=280, env=dict(os.environ))
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    assert res.returncode == 0 and lines, (res.stdout + res.stderr)[-5000:]
    out = json.loads(lines[0][len("RESULT "):])
    assert out["client"] is True
    assert out["run"] == [[0, 2, 30.0], [1, 2, 30.0]]
    assert [s["rank"] for s in out["seen"]] == [0], out["seen"]  # rank 0's values, on the client
    assert out["single"] == "rank0" and out["remote"] == [7, 7]
    name, text = out["error"]
    assert "rank 1" in text and "boom on rank 1" in text, out["error"]
