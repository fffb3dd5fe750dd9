"""Rank body for tests/integration/test_monitor.py, started by ``horovodrun --monitor-port``.

    monitor_worker.py job     200 steps with no delay, a known set of tensors, then 5 steps in
                              which rank 2 sleeps 50 ms before submitting, then one tensor rank 2
                              holds back for 3 s (a stall); prints RESULT_<phase>
    monitor_worker.py page F [S]  steps until file F exists, then rank 1 raises (the others fail
                              after); rank S (if given) takes 30 ms longer per step
    monitor_worker.py steps S N [Q]  training-like steps (a little CPU work, 40 ms of "device
                              compute" the CPU idles through, 8 tensors): 10 to reach
                              a steady state, then Q (default 0) in which nobody is delayed
                              (prints RESULT_quiet with the verdicts after them; rank 0 also
                              scrapes /metrics), then N more in which rank S (-1: none) sleeps
                              50 ms per step; prints RESULT_steps with the seconds from the end of
                              the undelayed steps to the first verdict naming S (rank 0 scrapes)
    monitor_worker.py stuck D     3 allreduces 'stacks.warmup', then every rank blocks in
                              wait_for_the_test_to_release_me() reading the FIFO D/release.<rank>
                              until the test writes to it; then one more allreduce, RESULT_stuck

Results are ``[r]<stdout>:RESULT_<phase> {json}`` lines. Rank 0 also reads the monitor's
``/metrics`` (on 127.0.0.1: no token) once every rank has reported the verdict.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.request

import numpy as np

import horovod.numpy as hvd

STEP = np.ones(8, np.float32)


def emit(phase: str, **data: object) -> None:
    print(f"RESULT_{phase} " + json.dumps({"rank": hvd.rank(), **data}), flush=True)


def next_verdict() -> dict:
    """hvd.metrics() after the coordinator's next straggler exchange (a collective round)."""
    seen = hvd.metrics()["exchanges"]
    deadline = time.monotonic() + 60
    while hvd.metrics()["exchanges"] <= seen:
        if time.monotonic() > deadline:
            raise TimeoutError("no straggler exchange within 60 s")
        time.sleep(0.02)
    return hvd.metrics()


def scrape() -> str:
    url = f"http://{os.environ['HOROVOD_MONITOR_ADDR']}:{os.environ['HOROVOD_MONITOR_PORT']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def series(text: str, name: str) -> dict[str, float]:
    """``{rank: value}`` of one metric's series."""
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{name}{{rank="(\d+)"[^}}]*}} (\S+)$', text, re.MULTILINE)}


def scrape_until(want_reports: int, check: object) -> str:
    """Rank 0: /metrics once every rank has reported ``check`` (its own verdict), or after 60 s."""
    deadline = time.monotonic() + 60
    text = scrape()
    while time.monotonic() < deadline:
        text = scrape()
        if check(text):  # type: ignore[operator]
            break
        time.sleep(0.2)
    return text


def job() -> None:
    size, rank = hvd.size(), hvd.rank()
    # 1. 200 steps, nobody delayed: nobody may be flagged at any round.
    for _ in range(200):
        hvd.allreduce(STEP, name="step")
    m = next_verdict()
    emit("quiet", flag_events=m["straggler_flag_events"], stragglers=m["stragglers"],
         steps=m["steps"], exchanges=m["exchanges"])
    # 2. Known tensors: the byte counters must match exactly.
    before = hvd.metrics()
    hvd.allreduce(np.zeros((3, 4), np.float64), name="b.f64")
    hvd.allreduce(np.zeros(7, np.int32), name="b.i32")
    hvd.grouped_allreduce([np.zeros(5, np.float32), np.zeros((2, 2), np.float32)], name="b.group")
    hvd.allgather(np.zeros((rank + 1, 3), np.float32), name="b.gather")
    hvd.broadcast(np.zeros(6, np.int64), root_rank=0, name="b.bcast")
    after = hvd.metrics()
    delta = {op: after["collective_bytes"][op] - before["collective_bytes"].get(op, 0)
             for op in after["collective_bytes"]}
    count = {op: after["collectives"][op] - before["collectives"].get(op, 0) for op in after["collectives"]}
    emit("bytes", bytes=delta, count=count, seconds=after["collective_seconds"],
         wait=after["wait_seconds"], keys=sorted(after))
    # 3. Rank 2 sleeps 50 ms before each of 5 steps: flagged within those 5 steps.
    for _ in range(5):
        if rank == 2:
            time.sleep(0.05)
        hvd.allreduce(STEP, name="step")
    m = next_verdict()
    emit("straggler", stragglers=m["stragglers"], straggler=m["straggler"],
         score=m["straggler_score"], scores=m["straggler_scores"])
    # 4. Rank 2 holds a tensor back past the stall warning time (the launch sets it to 1 s): the
    # stall inspector's warning names it as missing, and as the straggler.
    if rank == 2:
        time.sleep(3.0)
    hvd.allreduce(STEP, name="stall.x")
    if rank == 0:
        want = {str(r): (1.0 if r in m["stragglers"] else 0.0) for r in range(size)}
        text = scrape_until(size, lambda t: series(t, "horovod_straggler") == want)
        emit("scrape", straggler=series(text, "horovod_straggler"),
             bytes=series(text, "horovod_collective_bytes_total"), text=text)
    hvd.barrier()


def page(flag: str, slow_rank: int = -1) -> None:
    rng = np.random.default_rng(hvd.rank())
    while True:
        if os.path.exists(flag) and hvd.rank() == 1:
            raise RuntimeError("injected failure on rank 1 (the monitor test)")
        hvd.allreduce(STEP, name="step")
        time.sleep(0.02 + (0.03 if hvd.rank() == slow_rank else 0.0) + 0.01 * rng.random())


def scraped_verdicts(m: dict) -> dict[str, float] | None:
    """Rank 0: the ``horovod_straggler`` series once every rank reported ``m``'s verdict; None elsewhere."""
    if hvd.rank() != 0:
        return None
    want = {str(r): (1.0 if r in m["stragglers"] else 0.0) for r in range(hvd.size())}
    return series(scrape_until(hvd.size(), lambda t: series(t, "horovod_straggler") == want), "horovod_straggler")


def steps(slow_rank: int, n: int, quiet: int = 0) -> None:
    rank = hvd.rank()
    a = np.random.default_rng(rank).random((64, 64))
    grads = [np.ones(1000, np.float32) for _ in range(8)]

    def step(delay: bool) -> None:
        nonlocal a
        for _ in range(4):
            a = a @ a
            a /= np.abs(a).max()
        time.sleep(0.04)  # the step's device compute (the CPU idles meanwhile)
        if delay and rank == slow_rank:
            time.sleep(0.05)
        for h in [hvd.allreduce_async(g, name=f"grad.{i}") for i, g in enumerate(grads)]:
            hvd.synchronize(h)

    for _ in range(10):
        step(False)
    if quiet:
        for _ in range(quiet):
            step(False)
        m = hvd.metrics()
        emit("quiet", steps=quiet, stragglers=m["stragglers"], flag_events=m["straggler_flag_events"],
             scores=m["straggler_scores"], scrape=scraped_verdicts(m))
        hvd.barrier()
    start = time.monotonic()
    flagged_after = None
    for _ in range(n):
        step(True)
        if flagged_after is None and hvd.metrics()["stragglers"] == [slow_rank]:
            flagged_after = time.monotonic() - start
    m = hvd.metrics()
    emit("steps", flagged_after=flagged_after, seconds=time.monotonic() - start,
         stragglers=m["stragglers"], flag_events=m["straggler_flag_events"],
         scores=m["straggler_scores"], scrape=scraped_verdicts(m))
    hvd.barrier()


def wait_for_the_test_to_release_me(fifo: str) -> bytes:
    """Blocks (in C, the GIL released) until the test opens the FIFO and writes to it."""
    with open(fifo, "rb", buffering=0) as f:
        return f.read(1)


def stuck(directory: str) -> None:
    for _ in range(3):
        hvd.allreduce(STEP, name="stacks.warmup")
    got = wait_for_the_test_to_release_me(os.path.join(directory, f"release.{hvd.rank()}"))
    total = hvd.allreduce(STEP, name="stacks.after", op=hvd.Sum)
    emit("stuck", released=got.decode(), total=float(total[0]))


if __name__ == "__main__":
    hvd.init()
    if sys.argv[1] == "job":
        job()
    elif sys.argv[1] == "stuck":
        stuck(sys.argv[2])
    elif sys.argv[1] == "steps":
        steps(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 0)
    else:
        page(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else -1)
