"""Core engine against raw mpi4py, on the same buffers, in the same processes, interleaved.

Run under mpirun (rank 0 prints one JSON object per measurement):

    mpirun -np 2 python benchmarks/core_bench.py --suite all

Suites:
  latency   one blocking allreduce of N bytes: raw ``Comm.Allreduce`` vs ``hvd.allreduce``
  gradsync  average every gradient of ResNet-50 / BERT-base: raw one flat buffer, raw one call per
            tensor, ``hvd.allreduce_async_`` per tensor + ``synchronize``, ``hvd.grouped_allreduce_``
  ntensors  10 .. 10,000 small tensors (1 KiB each) through the async path vs raw per-tensor calls
Each repetition runs every mode once, in turn, so machine noise hits them alike; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import MODELS  # noqa: E402

import horovod.numpy as hvd  # noqa: E402


def timed(fn, reps, barrier):
    out = []
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def interleave(modes: dict, reps: int, warmup: int, barrier) -> dict:
    for fn in modes.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in modes}
    for _ in range(reps):
        for k, fn in modes.items():
            times[k] += timed(fn, 1, barrier)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--suite", default="all", choices=["all", "latency", "gradsync", "ntensors"])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--models", default="resnet50,bert_base")
    a = p.parse_args()
    from mpi4py import MPI

    hvd.init()
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    emit = (lambda d: print(json.dumps(d), flush=True)) if rank == 0 else (lambda d: None)
    barrier = comm.Barrier

    if a.suite in ("all", "latency"):
        for nbytes in [4, 1024, 262144, 4 << 20, 64 << 20]:
            n = nbytes // 4
            x = np.ones(n, np.float32)
            out = np.empty_like(x)
            inner = max(3, min(400, (64 << 20) // max(nbytes, 1) // 64))
            y = np.ones(n, np.float32)
            modes = {
                # raw, reusing one output buffer (warm pages)
                "raw_mpi": lambda x=x, out=out, inner=inner: [comm.Allreduce(x, out) for _ in range(inner)],
                # raw, into a new output each call: what an out-of-place allreduce must do
                "raw_mpi_fresh": lambda x=x, inner=inner: [comm.Allreduce(x, np.empty_like(x))
                                                           for _ in range(inner)],
                "horovod": lambda x=x, inner=inner: [hvd.allreduce(x, op=hvd.Sum, name="lat") for _ in range(inner)],
                # in place, as DistributedOptimizer does
                "horovod_inplace": lambda y=y, inner=inner: [hvd.allreduce_(y, op=hvd.Sum, name="lat_")
                                                             for _ in range(inner)],
            }
            med = interleave(modes, reps=max(5, a.reps // 2), warmup=1, barrier=barrier)
            emit({"suite": "latency", "np": size, "bytes": nbytes,
                  **{k: v / inner * 1e6 for k, v in med.items()}, "unit": "us"})

    if a.suite in ("all", "gradsync"):
        for model in a.models.split(","):
            shapes = MODELS[model]()
            numel = sum(math.prod(s) for s in shapes)
            flat = np.ones(numel, np.float32)
            each = [np.ones(s, np.float32) for s in shapes]
            grads = [np.ones(s, np.float32) for s in shapes]
            names = [f"g{i}" for i in range(len(shapes))]

            def raw_flat(flat=flat):
                comm.Allreduce(MPI.IN_PLACE, flat)
                np.divide(flat, size, out=flat)

            def raw_each(each=each):
                for t in each:
                    comm.Allreduce(MPI.IN_PLACE, t)
                    np.divide(t, size, out=t)

            def hvd_async(grads=grads, names=names):
                hs = [hvd.allreduce_async_(g, name=nm, op=hvd.Average) for g, nm in zip(grads, names)]
                for h in hs:
                    hvd.synchronize(h)

            def hvd_grouped(grads=grads):
                hvd.grouped_allreduce_(grads, name="grads", op=hvd.Average)

            med = interleave({"raw_mpi_flat": raw_flat, "raw_mpi_each": raw_each,
                              "horovod_async": hvd_async, "horovod_grouped": hvd_grouped},
                             reps=a.reps, warmup=2, barrier=barrier)
            emit({"suite": "gradsync", "np": size, "model": model, "tensors": len(shapes),
                  "MiB": numel * 4 / 2**20, **{k: v * 1e3 for k, v in med.items()}, "unit": "ms"})

    if a.suite in ("all", "ntensors"):
        for count in [10, 100, 1000, 10000]:
            arrs = [np.ones(256, np.float32) for _ in range(count)]
            raws = [np.ones(256, np.float32) for _ in range(count)]
            names = [f"s{i}" for i in range(count)]

            def raw_each(raws=raws):
                for t in raws:
                    comm.Allreduce(MPI.IN_PLACE, t)

            def hvd_async(arrs=arrs, names=names):
                hs = [hvd.allreduce_async_(t, name=nm, op=hvd.Sum) for t, nm in zip(arrs, names)]
                for h in hs:
                    hvd.synchronize(h)

            med = interleave({"raw_mpi_each": raw_each, "horovod_async": hvd_async},
                             reps=max(3, a.reps // 3), warmup=1, barrier=barrier)
            emit({"suite": "ntensors", "np": size, "tensors": count,
                  **{k: v * 1e3 for k, v in med.items()}, "unit": "ms"})
    hvd.shutdown()


if __name__ == "__main__":
    main()
