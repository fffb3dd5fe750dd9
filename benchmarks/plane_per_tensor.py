"""Host-side cost per tensor of the torch device plane: submit and synchronize many tiny tensors.

The tensors are tiny, so the time is the Python work per tensor (wrapping, events, negotiation,
packing, scaling, waiting), not the transport. On a GPU it runs on CUDA; without one, on the CPU
twin (``HOROVOD_TORCH_CPU_PLANE=1``, Gloo), which runs the same plane code minus the CUDA calls:

    python benchmarks/plane_per_tensor.py [--tensors 161] [--numel 256] [--reps 30]

Prints the median per step of: submit (``allreduce_async_`` of every tensor, Average), sync
(``synchronize`` of every handle) and grouped (``grouped_allreduce_`` of all), in microseconds
per tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HOROVOD_TORCH_CPU_PLANE", "1")

import torch  # noqa: E402

import horovod.torch as hvd  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--tensors", type=int, default=161)
parser.add_argument("--numel", type=int, default=256)
parser.add_argument("--reps", type=int, default=30)


def main() -> None:
    args = parser.parse_args()
    hvd.init()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(hvd.local_rank())
    ts = [torch.ones(args.numel, device=device) for _ in range(args.tensors)]
    names = [f"t{i}" for i in range(args.tensors)]

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    submit, wait, grouped = [], [], []
    for rep in range(args.reps + 3):
        sync()
        t0 = time.perf_counter()
        hs = [hvd.allreduce_async_(t, name=n) for t, n in zip(ts, names)]
        t1 = time.perf_counter()
        for h in hs:
            hvd.synchronize(h)
        sync()
        t2 = time.perf_counter()
        hvd.grouped_allreduce_(ts, name="all")
        sync()
        t3 = time.perf_counter()
        if rep >= 3:
            submit.append(t1 - t0)
            wait.append(t2 - t1)
            grouped.append(t3 - t2)
    per = 1e6 / args.tensors
    out = {"device": device, "tensors": args.tensors, "numel": args.numel,
           "submit_us_per_tensor": round(statistics.median(submit) * per, 1),
           "sync_us_per_tensor": round(statistics.median(wait) * per, 1),
           "grouped_us_per_tensor": round(statistics.median(grouped) * per, 1)}
    if hvd.rank() == 0:
        print(json.dumps(out))
    hvd.shutdown()


if __name__ == "__main__":
    main()
