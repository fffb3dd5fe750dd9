"""Per-step times of ResNet-50's gradient set on the MPI plane, every step printed (not medians only).

    horovodrun -np 2 python benchmarks/mpi_plane_steps.py [--reps 10] [--dtype float32]
    horovodrun -np 2 python benchmarks/mpi_plane_steps.py --phases --modes hvd   # where a step goes

Modes (each repetition runs every mode once, in turn, after a barrier):
  flat  one mpi4py ``Allreduce`` of one flat float32 buffer of the same size, then / size (the
        reference of docs/performance.md's "The MPI data plane")
  hvd   ``horovod.torch.allreduce_async_`` of each of the 161 tensors, then ``synchronize`` each
  grp   ``horovod.torch.grouped_allreduce_`` of the 161 tensors

Rank 0 prints one JSON line (medians, the load average, huge pages) and, per mode, every step's
milliseconds, the milliseconds inside the backend's MPI calls on each rank (``mpi0``/``mpi1``) and
rank 0's minor page faults per step. ``--phases`` times the engine's parts of every step instead
(packing into and out of the fusion buffer, scaling, MPI, negotiation; calls reduced in place
against through the buffer).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import MODELS  # noqa: E402

import horovod.torch as hvd  # noqa: E402
from horovod.common.backends import mpi as mpi_backend  # noqa: E402
from horovod.common.engine import buffers, placement  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default="resnet50", choices=sorted(MODELS))
parser.add_argument("--reps", type=int, default=10)
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--modes", default="flat,hvd,grp")
parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
parser.add_argument("--phases", action="store_true")

_acc: dict[str, list[float]] = {}


def _timed(cls: Any, name: str, key: str, static: bool = False) -> None:
    orig = cls.__dict__[name]
    fn = orig.__func__ if static else orig

    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            d = _acc.setdefault(key, [0.0, 0])
            d[0] += time.perf_counter() - t0
            d[1] += 1
    setattr(cls, name, staticmethod(wrapper) if static else wrapper)


def _instrument(phases: bool) -> dict[str, int]:
    _timed(mpi_backend.MPIBackend, "allreduce", "mpi")
    where = {"in_place": 0, "buffered": 0}
    if not phases:
        return where
    for name in ("and_bits", "gather_to_root", "bcast_from_root"):
        _timed(mpi_backend.MPIBackend, name, "negotiation")
    _timed(buffers.NumpyBuffers, "pack", "pack")
    _timed(buffers.NumpyBuffers, "unpack", "unpack")
    _timed(buffers.NumpyBuffers, "scale", "scale", static=True)
    region = placement.HostPlacement.region

    def counted(self: Any, call: Any, items: Any, segs: Any, ops: Any) -> Any:
        r = region(self, call, items, segs, ops)
        where["in_place" if r is not None else "buffered"] += 1
        return r
    placement.HostPlacement.region = counted  # type: ignore[method-assign]
    return where


def main() -> None:
    args = parser.parse_args()
    where = _instrument(args.phases)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(1)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    shapes = MODELS[args.model]()
    numel = sum(math.prod(s) for s in shapes)
    flat = np.ones(numel, np.float32)
    tensors = [torch.ones(s, dtype=getattr(torch, args.dtype)) for s in shapes]
    names = [f"grad.{i}" for i in range(len(tensors))]

    def mode_flat() -> None:
        comm.Allreduce(MPI.IN_PLACE, flat)
        np.divide(flat, size, out=flat)

    def mode_hvd() -> None:
        handles = [hvd.allreduce_async_(t, name=n, op=hvd.Average) for t, n in zip(tensors, names)]
        for h in handles:
            hvd.synchronize(h)

    def mode_grp() -> None:
        hvd.grouped_allreduce_(tensors, name="grads", op=hvd.Average)

    every: dict[str, Callable[[], None]] = {"flat": mode_flat, "hvd": mode_hvd, "grp": mode_grp}
    modes = {k: every[k] for k in args.modes.split(",")}
    for fn in modes.values():
        for _ in range(args.warmup):
            fn()
    ms: dict[str, list[float]] = {k: [] for k in modes}
    mpi_ms: dict[str, list[float]] = {k: [] for k in modes}
    faults: dict[str, list[int]] = {k: [] for k in modes}
    phases: list[dict[str, Any]] = []
    for _ in range(args.reps):
        for k, fn in modes.items():
            comm.Barrier()
            _acc.clear()
            where.update(in_place=0, buffered=0)
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            fn()
            ms[k].append((time.perf_counter() - t0) * 1e3)
            faults[k].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            mpi_ms[k].append(_acc.get("mpi", [0.0])[0] * 1e3)
            if args.phases and k != "flat":
                phases.append({"mode": k, "ms": round(ms[k][-1], 1),
                               **{p: round(v[0] * 1e3, 1) for p, v in _acc.items()}, **where})
    huge = 0
    with open("/proc/self/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("AnonHugePages"):
                huge = int(line.split()[1]) // 1024
    inner = comm.gather(mpi_ms, 0)
    if rank != 0:
        return
    med = {k: statistics.median(v) for k, v in ms.items()}
    print(json.dumps({"bench": "mpi_plane_steps", "model": args.model, "dtype": args.dtype, "np": size,
                      "load": [round(x, 1) for x in os.getloadavg()],
                      "median_ms": {k: round(v, 1) for k, v in med.items()},
                      "vs_flat": {k: round(v / med["flat"], 2) for k, v in med.items()} if "flat" in med else {},
                      "anon_huge_MiB_rank0": huge}), flush=True)
    for k in modes:
        print(f"{k:5s} ms    ", " ".join(f"{x:.0f}" for x in ms[k]))
        for r, per_rank in enumerate(inner or []):
            print(f"{k:5s} mpi{r}  ", " ".join(f"{x:.0f}" for x in per_rank[k]))
        print(f"{k:5s} faults", " ".join(str(x) for x in faults[k]))
    for row in phases:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
