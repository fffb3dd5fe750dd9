"""Adasum vs Average allreduce of one float32 tensor through horovod.numpy, interleaved in one run.

    mpirun -np 2 python benchmarks/adasum_bench.py
    mpirun --oversubscribe -np 4 python benchmarks/adasum_bench.py

Rank 0 prints one JSON line per size: median milliseconds of each op over ``--reps`` repetitions
(the two ops alternate, so machine noise hits them alike) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import horovod.numpy as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--sizes", default="1024,262144,4194304", help="elements (float32)")
parser.add_argument("--reps", type=int, default=15)


def main() -> None:
    args = parser.parse_args()
    hvd.init()
    for n in (int(s) for s in args.sizes.split(",")):
        x = np.random.default_rng(hvd.rank()).standard_normal(n).astype(np.float32)
        times: dict[str, list[float]] = {"average": [], "adasum": []}
        for rep in range(args.reps + 2):
            for label, op in (("average", hvd.Average), ("adasum", hvd.Adasum)):
                hvd.barrier()
                t0 = time.perf_counter()
                hvd.allreduce(x, op=op, name=f"{label}.{n}")
                if rep >= 2:
                    times[label].append(time.perf_counter() - t0)
        if hvd.rank() == 0:
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(json.dumps({"np": hvd.size(), "elements": n, "MiB": round(n * 4 / 2**20, 3),
                              "average_ms": round(med["average"], 3), "adasum_ms": round(med["adasum"], 3),
                              "adasum_over_average": round(med["adasum"] / med["average"], 2)}))


if __name__ == "__main__":
    main()
