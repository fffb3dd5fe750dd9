"""Hierarchical vs flat allreduce/allgather, interleaved in one run (run under horovodrun across hosts).

    python benchmarks/run_hierarchical.py            # makes 2 fake hosts x 2 ranks and runs this

or on real hosts:

    horovodrun -np 4 -H a:2,b:2 python benchmarks/hierarchical_bench.py

Every repetition runs each case once with the flat collective and once hierarchically (the
executor's ``hierarchical_allreduce``/``hierarchical_allgather`` switched on every rank between
blocking calls). Rank 0 prints one JSON line: medians in ms per case and mode.
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

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--reps", type=int, default=7)
parser.add_argument("--warmup", type=int, default=1)


def main() -> None:
    args = parser.parse_args()
    import horovod.numpy as hvd
    from horovod.common.context import get_context

    hvd.init()
    ex = get_context().engine._executor
    rank, size = hvd.rank(), hvd.size()
    hier = ex._hierarchy(get_context().groups[0])
    grads = [np.ones(s, np.float32) for s in MODELS["resnet50"]()]
    big = np.ones(16 << 20, np.float32)
    piece = np.full((2 << 20, 1), rank, np.float32)  # 8 MiB per rank

    def gradset() -> None:
        hs = [hvd.allreduce_async_(g, name=f"g{i}", op=hvd.Average) for i, g in enumerate(grads)]
        for h in hs:
            hvd.synchronize(h)

    def single64() -> None:
        hvd.allreduce_(big, name="big", op=hvd.Average)

    def allgather() -> None:
        hvd.allgather(piece, name="ag")

    cases = {"resnet50 gradient set allreduce (97.5 MiB)": gradset, "one 64 MiB allreduce": single64,
             f"allgather 8 MiB per rank ({size * 8} MiB out)": allgather}
    times: dict[str, dict[str, list[float]]] = {c: {"flat": [], "hierarchical": []} for c in cases}
    for rep in range(args.warmup + args.reps):
        for c, fn in cases.items():
            for mode in ("flat", "hierarchical"):
                ex.hierarchical_allreduce = ex.hierarchical_allgather = mode == "hierarchical"
                hvd.barrier()
                t0 = time.perf_counter()
                fn()
                if rep >= args.warmup:
                    times[c][mode].append(time.perf_counter() - t0)
    if rank == 0:
        med = {c: {m: round(statistics.median(v) * 1e3, 2) for m, v in d.items()} for c, d in times.items()}
        print("HIER_RESULT " + json.dumps({
            "np": size, "local_size": hvd.local_size(), "cross_size": hvd.cross_size(),
            "hierarchy_applies": hier is not None, "reps": args.reps, "median_ms": med,
            "mib_gradset": round(sum(math.prod(g.shape) for g in grads) * 4 / 2**20, 1),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}), flush=True)


if __name__ == "__main__":
    main()
