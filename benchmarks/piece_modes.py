"""Raw MPI piece schedules over time: which piece size is fastest, and whether that changes within
one process (docs/performance.md, "The piece size follows the machine").

    mpirun -np 2 --oversubscribe python benchmarks/piece_modes.py --sizes 2048,16384 --seconds 40
    mpirun -np 2 --oversubscribe python benchmarks/piece_modes.py --sweep 512,1024,2048,4096,8192,16384,32768

Raw mpi4py only (no Horovod in the process): ResNet-50's gradient set as one flat float32 buffer
(97.5 MiB, on transparent huge pages as NumPy allocates it), reduced in place in pieces of the
given KiB, each piece averaged while hot, and one flat ``Allreduce`` of it all (``flat``), after a
barrier, every size in turn in every repetition.

* ``--seconds S``: repeat for S seconds; rank 0 prints one JSON line with every repetition's
  milliseconds per size (the time series: a change of state shows as a run of slow steps of one
  size while another keeps its speed);
* ``--sweep``: 12 repetitions; rank 0 prints the median of the last 10 per size.
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
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import MODELS  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2048,16384", help="piece sizes in KiB, comma-separated")
    p.add_argument("--sweep", default="", help="piece sizes in KiB: the sweep instead of a time series")
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--model", default="resnet50")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    n = sum(math.prod(s) for s in MODELS[args.model]())
    flat = np.ones(n, np.float32)
    scale = np.float32(1.0 / comm.size)

    def run(kib: int) -> None:
        if kib <= 0:
            comm.Allreduce(MPI.IN_PLACE, flat)
            np.multiply(flat, scale, out=flat)
            return
        step = kib * 1024 // 4
        for i in range(0, n, step):
            v = flat[i:i + step]
            comm.Allreduce(MPI.IN_PLACE, v)
            np.multiply(v, scale, out=v)

    sizes = [int(x) for x in (args.sweep or args.sizes).split(",")] + [0]
    ms: dict[int, list[float]] = {k: [] for k in sizes}
    t_end = time.monotonic() + args.seconds
    rep = 0
    while True:
        for k in sizes:
            comm.Barrier()
            t = time.perf_counter()
            run(k)
            ms[k].append((time.perf_counter() - t) * 1e3)
        rep += 1
        done = rep >= 12 if args.sweep else time.monotonic() > t_end
        if comm.bcast(done if comm.rank == 0 else None, root=0):
            break
    if comm.rank != 0:
        return
    label = {k: (f"{k // 1024}MiB" if k >= 1024 else f"{k}KiB") if k else "flat" for k in sizes}
    out: dict[str, object] = {"bench": "piece_modes", "np": comm.size, "load": [round(x, 1) for x in os.getloadavg()]}
    if args.sweep:
        out["median_ms"] = {label[k]: round(statistics.median(v[2:]), 1) for k, v in ms.items()}
    else:
        out["reps"] = rep
        out["ms"] = {label[k]: [round(x, 1) for x in v] for k, v in ms.items()}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
