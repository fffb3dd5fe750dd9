"""Reading the monitor's ``/metrics`` (Prometheus text exposition) in tests, and the rank body the
Spark and Ray monitor tests run: allreduce steps until rank 0 has read ``/metrics`` on the driver
with every rank's counters in it. Shipped to executors and actors by value (cloudpickle)."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^(horovod_\w+)(?:\{([^}]*)\})? (\S+)$")


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """``(labels, value)`` of every sample of metric ``name``."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            out.append((dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")), float(m.group(3))))
    return out


def every_rank_counted(text: str, size: int) -> bool:
    ranks = {lab["rank"] for lab, v in samples(text, "horovod_collectives_total")
             if lab["op"] == "allreduce" and v > 0}
    return ranks == {str(r) for r in range(size)}


def check_metrics(text: str, size: int) -> None:
    """One ``horovod_rank_info`` per rank, and every rank's allreduces, bytes and steps counted
    (the rank body's allreduces are 4 float32s: 16 bytes each, exactly)."""
    info = samples(text, "horovod_rank_info")
    assert sorted(int(lab["rank"]) for lab, _ in info) == list(range(size)), text
    counted = {lab["rank"]: v for lab, v in samples(text, "horovod_collectives_total")
               if lab["op"] == "allreduce"}
    nbytes = {lab["rank"]: v for lab, v in samples(text, "horovod_collective_bytes_total")
              if lab["op"] == "allreduce"}
    steps = {lab["rank"]: v for lab, v in samples(text, "horovod_steps_total")}
    for r in map(str, range(size)):
        assert counted.get(r, 0) > 0 and steps.get(r, 0) > 0, (r, text)
        assert nbytes[r] == 16 * counted[r], (r, text)


def steps_reading_metrics(port: int) -> str:
    """Allreduce steps until rank 0 has read /metrics with every rank's counters in it; rank 0
    returns what it read last (the others an empty string)."""
    import time
    import urllib.request

    import numpy as np

    import horovod.numpy as hvd

    hvd.init()
    text, deadline = "", time.monotonic() + 120
    while True:
        hvd.allreduce(np.ones(4, np.float32), name="grad")
        done = 0
        if hvd.rank() == 0:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
            done = int(every_rank_counted(text, hvd.size()) or time.monotonic() > deadline)
        if hvd.broadcast(np.array([done]), 0, name="stop")[0]:
            break
        time.sleep(0.05)
    hvd.shutdown()
    return text


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
