"""Gradient-set sync through horovod.torch against raw MPI and Gloo, same processes, interleaved.

Run under mpirun or horovodrun (rank 0 prints one line per mode and the ratios):

    mpirun -np 2 python benchmarks/torch_gradsync.py --model resnet50
    horovodrun -np 2 python benchmarks/torch_gradsync.py

Modes (every repetition runs each mode once, in turn, so machine noise hits them alike):
  mpi-flat     one mpi4py Allreduce of one float32 buffer of the same total size, then /size
               (the transport's limit for these bytes)
  hvd          horovod.torch allreduce_async_ of each gradient tensor, then synchronize each
               (what DistributedOptimizer does)
  hvd-grouped  horovod.torch grouped_allreduce_ of all gradient tensors
  gloo-bucket  torch.distributed (Gloo) all_reduce over 25 MiB flat buckets (what DDP does);
               skip with --no-gloo
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import MODELS  # noqa: E402

import horovod.torch as hvd  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default="resnet50", choices=sorted(MODELS))
parser.add_argument("--reps", type=int, default=20)
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--no-gloo", action="store_true")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    args = parser.parse_args()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(1)
    shapes = MODELS[args.model]()
    numel = sum(math.prod(s) for s in shapes)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    flat = np.ones(numel, np.float32)
    tensors = [torch.ones(s) for s in shapes]
    names = [f"grad.{i}" for i in range(len(tensors))]

    def mpi_flat() -> None:
        comm.Allreduce(MPI.IN_PLACE, flat)
        np.divide(flat, size, out=flat)

    def hvd_async() -> None:
        handles = [hvd.allreduce_async_(t, name=n, op=hvd.Average) for t, n in zip(tensors, names)]
        for h in handles:
            hvd.synchronize(h)

    def hvd_grouped() -> None:
        hvd.grouped_allreduce_(tensors, name="grads", op=hvd.Average)

    modes = {"mpi-flat": mpi_flat, "hvd": hvd_async, "hvd-grouped": hvd_grouped}
    if not args.no_gloo:
        import torch.distributed as dist

        port = hvd.broadcast_object(_free_port() if rank == 0 else None, 0, name="gloo.port")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        gts = [torch.ones(s) for s in shapes]
        cap = 25 * 2**20 // 4
        buckets, cur = [], []
        for t in reversed(gts):
            cur.append(t)
            if sum(x.numel() for x in cur) >= cap:
                buckets.append(cur)
                cur = []
        if cur:
            buckets.append(cur)
        flats = [torch.zeros(sum(x.numel() for x in b)) for b in buckets]

        def gloo_bucket() -> None:
            works = []
            for b, f in zip(buckets, flats):
                torch.cat([x.reshape(-1) for x in b], out=f)
                works.append(dist.all_reduce(f, async_op=True))
            for b, f, w in zip(buckets, flats, works):
                w.wait()
                f /= size
                o = 0
                for x in b:
                    x.copy_(f[o:o + x.numel()].view_as(x))
                    o += x.numel()

        modes["gloo-bucket"] = gloo_bucket

    for fn in modes.values():
        for _ in range(args.warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in modes}
    for _ in range(args.reps):
        for k, fn in modes.items():
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    if rank == 0:
        base = statistics.median(times["mpi-flat"])
        for k, ts in times.items():
            med = statistics.median(ts)
            print(json.dumps({"bench": "torch_gradsync", "model": args.model, "np": size, "tensors": len(shapes),
                              "MiB": round(numel * 4 / 2**20, 1), "mode": k, "median_ms": round(med * 1e3, 2),
                              "min_ms": round(min(ts) * 1e3, 2), "ratio_to_mpi_flat": round(med / base, 3)}),
                  flush=True)
    if not args.no_gloo:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
