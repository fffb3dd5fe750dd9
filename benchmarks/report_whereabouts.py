"""What saying where a rank is adds to each monitor report (``horovod.common.reporter.whereabouts``).

    horovodrun -np 2 python benchmarks/report_whereabouts.py [--calls 2000] [--depth 30]

Each rank's main thread runs steps of 161 tiny allreduces (``allreduce_async`` then
``synchronize``), at a Python depth of ``--depth`` frames, while a second thread (as the
reporter's does) times, interleaved call by call: ``whereabouts(flight_record)`` (the
main thread's stack, formatted, and the last 8 completed and first 8 in-flight collectives), and
the report's existing part, ``engine.metrics_snapshot()``: wall time (which includes waiting for
the GIL the main thread holds) and the measuring thread's CPU time (``time.thread_time``, whose
resolution may be coarse), also of the stack alone (``whereabouts(None)``). Rank 0 prints JSON:
medians and 90th percentiles in microseconds, and the bytes the new fields add to a report's
JSON body.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np

import horovod.numpy as hvd
from horovod.common.context import get_context
from horovod.common.reporter import whereabouts

parser = argparse.ArgumentParser()
parser.add_argument("--calls", type=int, default=2000)
parser.add_argument("--depth", type=int, default=30)
args = parser.parse_args()

hvd.init()
engine = get_context().engine
assert engine is not None, "hvd.init() started no engine"
flight_record, metrics_snapshot = engine.flight_record, engine.metrics_snapshot
tensors = [np.ones(4, np.float32) for _ in range(161)]
stop = threading.Event()


def step() -> None:
    for h in [hvd.allreduce_async(t, name=f"grad.{i}") for i, t in enumerate(tensors)]:
        hvd.synchronize(h)


def train(depth: int) -> None:
    if depth:
        train(depth - 1)
        return
    while True:  # every rank stops at the same step: once any rank's measurement is done
        step()
        if hvd.allreduce(np.array([float(stop.is_set())]), name="stop", op=hvd.Sum)[0] > 0:
            return


def measure(out: dict) -> None:
    where, where_cpu, stack_cpu, snap, size = [], [], [], [], []
    for _ in range(args.calls):
        t0, c0 = time.perf_counter(), time.thread_time()
        w = whereabouts(flight_record)
        t1, c1 = time.perf_counter(), time.thread_time()
        metrics_snapshot()
        t2 = time.perf_counter()
        c2 = time.thread_time()
        whereabouts(None)
        c3 = time.thread_time()
        where.append(t1 - t0)
        where_cpu.append(c1 - c0)
        stack_cpu.append(c3 - c2)
        snap.append(t2 - t1)
        size.append(len(json.dumps(w)))
        time.sleep(0.001)

    def stats(xs: list[float]) -> dict:
        xs = sorted(xs)
        return {"median_us": round(statistics.median(xs) * 1e6, 1),
                "p90_us": round(xs[int(0.9 * (len(xs) - 1))] * 1e6, 1)}

    out.update(whereabouts=stats(where), whereabouts_cpu=stats(where_cpu),
               stack_only_cpu=stats(stack_cpu), metrics_snapshot=stats(snap),
               added_bytes_median=int(statistics.median(size)), added_bytes_max=max(size))
    stop.set()


step()
result: dict = {}
t = threading.Thread(target=measure, args=(result,), name="bench-reporter")
t.start()
train(args.depth)
t.join()
hvd.allreduce(np.ones(1), name="done")  # both ranks leave the loop before shutting down
if hvd.rank() == 0:
    print(json.dumps({"ranks": hvd.size(), "calls": args.calls, "depth": args.depth, **result}))
