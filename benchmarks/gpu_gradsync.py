"""GPU gradient sync: horovod.torch on the device plane against raw torch.distributed, same run.

On a GPU machine (one GPU is enough; np=1 measures the engine's overhead on the device):

    mpirun -np 1 python benchmarks/gpu_gradsync.py
    horovodrun -np 1 python benchmarks/gpu_gradsync.py --model resnet50

Without a GPU, ``--cpu-twin`` runs the same modes on CPU tensors through the plane's Gloo twin
(``HOROVOD_TORCH_CPU_PLANE=1``) against raw torch.distributed Gloo:

    mpirun -np 2 python benchmarks/gpu_gradsync.py --cpu-twin --reps 5

Modes (every repetition runs each mode once, in turn, so machine noise hits them alike; on CUDA
each mode ends with ``torch.cuda.synchronize()`` so the time covers the device work):
  raw-flat     one torch.distributed all_reduce (NCCL / Gloo) of one flat float32 buffer of the
               gradient set's total size, then /size: the library's limit for these bytes
  hvd          horovod.torch allreduce_async_ (Average) of each gradient, then synchronize each
               (what DistributedOptimizer does); ratio_to_raw_flat is the overhead (goal <= 1.05 at np=1)
  hvd-grouped  horovod.torch grouped_allreduce_ of all gradients
CUDA only, host staging against plain copies of the same bytes:
  memcpy       D2H into pinned memory + H2D back (what any host-staged path must at least pay)
  hvd-staged   horovod.torch broadcast_ of one buffer of the set's size on the host-staged path
               (this script sets HOROVOD_GPU_BROADCAST=MPI; at np=1 the transport itself is a no-op)
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

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import MODELS  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default="resnet50", choices=sorted(MODELS))
parser.add_argument("--reps", type=int, default=20)
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--cpu-twin", action="store_true", help="CPU tensors through the plane's Gloo twin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    args = parser.parse_args()
    cuda = not args.cpu_twin
    if cuda and not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: run with --cpu-twin to exercise the same code on CPU tensors")
    # The benchmark's own settings, before init (the library reads them there).
    if args.cpu_twin:
        os.environ["HOROVOD_TORCH_CPU_PLANE"] = "1"
    else:
        os.environ.setdefault("HOROVOD_GPU_BROADCAST", "MPI")
    import torch.distributed as dist

    import horovod.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if cuda:
        torch.cuda.set_device(hvd.local_rank())
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    shapes = MODELS[args.model]()
    numel = sum(math.prod(s) for s in shapes)
    tensors = [torch.ones(s, device=dev) for s in shapes]
    names = [f"grad.{i}" for i in range(len(tensors))]
    port = hvd.broadcast_object(_free_port() if rank == 0 else None, 0, name="raw.port")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    flat = torch.ones(numel, device=dev)

    def raw_flat() -> None:
        dist.all_reduce(flat)
        flat.div_(size)
        sync()

    def hvd_async() -> None:
        handles = [hvd.allreduce_async_(t, name=n, op=hvd.Average) for t, n in zip(tensors, names)]
        for h in handles:
            hvd.synchronize(h)
        sync()

    def hvd_grouped() -> None:
        hvd.grouped_allreduce_(tensors, name="grads", op=hvd.Average)
        sync()

    modes = {"raw-flat": raw_flat, "hvd": hvd_async, "hvd-grouped": hvd_grouped}
    if cuda:
        pinned = torch.empty(numel, pin_memory=True)
        staged = torch.ones(numel, device=dev)

        def memcpy() -> None:
            pinned.copy_(staged)
            staged.copy_(pinned, non_blocking=True)
            sync()

        def hvd_staged() -> None:
            hvd.broadcast_(staged, 0, name="staged")
            sync()

        modes.update({"memcpy": memcpy, "hvd-staged": hvd_staged})

    for fn in modes.values():
        for _ in range(args.warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in modes}
    for _ in range(args.reps):
        for k, fn in modes.items():
            hvd.barrier()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    if rank == 0:
        base = statistics.median(times["raw-flat"])
        device = torch.cuda.get_device_name(dev) if cuda else "cpu (twin)"
        for k, ts in times.items():
            med = statistics.median(ts)
            row = {"bench": "gpu_gradsync", "device": device, "model": args.model, "np": size,
                   "tensors": len(shapes), "MiB": round(numel * 4 / 2**20, 1), "mode": k,
                   "median_ms": round(med * 1e3, 3), "min_ms": round(min(ts) * 1e3, 3),
                   "ratio_to_raw_flat": round(med / base, 3)}
            if k in ("memcpy", "hvd-staged"):  # bytes moved device -> host -> device per second
                row["GB_per_s"] = round(2 * numel * 4 / med / 1e9, 2)
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
