"""Gradient compression through hvd.DistributedOptimizer: bytes per step, step time, accuracy.

Run under mpirun or horovodrun (rank 0 prints the table and one ``PSGD_RESULT`` JSON line):

    mpirun -np 2 python benchmarks/powersgd_bench.py --model resnet18 --reps 12
    mpirun -np 2 python benchmarks/powersgd_bench.py --accuracy

Step time: every variant has its own copy of the model's parameters (``benchmarks/shapes.py``)
and its own DistributedOptimizer; one step is ``zero_grad``, a backward pass that gives every
parameter a fixed random gradient (a multiply-add per element: the compute is negligible, the
step is communication and compression) and ``step()``. Every repetition runs each variant once,
in turn, so machine noise hits them alike; medians over the repetitions after the warm-up.
Bytes: what the step submitted to the engine (every allreduce's input buffers, per rank).

Accuracy (``--accuracy``): a 3-layer MLP on sklearn's digits (1300 train, 497 test images),
SGD with momentum, batch 16 per rank, 15 epochs, the same seeds for every variant.

Variants: none, fp16, bf16 (``hvd.Compression``), powersgd-R (``hvd.PowerSGD(rank=R,
start_iter=0)`` for step time, ``start_iter=10`` for accuracy), powersgd-R-noef (without error
feedback; accuracy only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import MODELS  # noqa: E402

import horovod.torch as hvd  # noqa: E402
from horovod.common.context import get_context  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default="resnet18", choices=sorted(MODELS))
parser.add_argument("--reps", type=int, default=12)
parser.add_argument("--warmup", type=int, default=2)
parser.add_argument("--variants", default="none,fp16,bf16,powersgd-2,powersgd-4")
parser.add_argument("--accuracy", action="store_true", help="train on digits instead of timing steps")
parser.add_argument("--epochs", type=int, default=15)
parser.add_argument("--seed", type=int, default=1)


def _compression(variant: str, start_iter: int):
    if variant in ("none", "fp16", "bf16"):
        return getattr(hvd.Compression, variant)
    parts = variant.split("-")
    return hvd.PowerSGD(rank=int(parts[1]), start_iter=start_iter, error_feedback=parts[-1] != "noef",
                        seed=0)


class _ByteCounter:
    """Counts the bytes of every operation submitted to this rank's engine, in the dtype its
    request reduces (a ``Compression.fp16`` float32 gradient is handed over as it is and counted as
    the 16 bits the engine narrows it to)."""

    def __init__(self) -> None:
        self.count = 0
        engine = get_context().engine
        submit, submit_many = engine.submit, engine.submit_many

        def one(entry, *a, **k):
            self.count += entry.request.nbytes
            return submit(entry, *a, **k)

        def many(entries, *a, **k):
            self.count += sum(e.request.nbytes for e in entries)
            return submit_many(entries, *a, **k)

        engine.submit, engine.submit_many = one, many


def step_times(args) -> dict:
    shapes = MODELS[args.model]()
    variants = args.variants.split(",")
    g = torch.Generator().manual_seed(hvd.rank())
    coeffs = [torch.randn(s, generator=g) for s in shapes]
    setups = {}
    for v in variants:
        params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in shapes])
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params.parameters(), lr=0.0),
                                       named_parameters=[(f"{v}.{n}", p) for n, p in params.named_parameters()],
                                       compression=_compression(v, start_iter=0))
        setups[v] = (params, opt)
    counter = _ByteCounter()
    times: dict[str, list[float]] = {v: [] for v in variants}
    sent: dict[str, int] = {}
    for rep in range(args.warmup + args.reps):
        for v in variants:
            params, opt = setups[v]
            hvd.barrier()
            before = counter.count
            t0 = time.perf_counter()
            opt.zero_grad()
            sum((p * c).sum() for p, c in zip(params, coeffs)).backward()
            opt.step()
            dt = time.perf_counter() - t0
            sent[v] = counter.count - before
            if rep >= args.warmup:
                times[v].append(dt)
    med = {v: statistics.median(t) * 1000 for v, t in times.items()}
    return {"model": args.model, "np": hvd.size(), "reps": args.reps,
            "numel": sum(p.numel() for p in setups[variants[0]][0]),
            "median_ms": med, "bytes_per_step": sent,
            "time_vs_none": {v: med[v] / med["none"] for v in variants} if "none" in med else {},
            "bytes_vs_none": {v: sent[v] / sent["none"] for v in variants} if "none" in sent else {}}


def _digits(variant: str, epochs: int, seed: int) -> float:
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    r, n = hvd.rank(), hvd.size()
    d = load_digits()
    x_all = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y_all = torch.tensor(d.target)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(x_all), generator=g)
    train, test = perm[:1300], perm[1300:]
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=_compression(variant, start_iter=10))
    for _ in range(epochs):
        mine = train[torch.randperm(len(train), generator=g)][r::n]
        for i in range(0, len(mine) - 15, 16):
            idx = mine[i:i + 16]
            opt.zero_grad()
            F.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
            opt.step()
    with torch.no_grad():
        return 100.0 * (model(x_all[test]).argmax(1) == y_all[test]).float().mean().item()


def accuracy(args) -> dict:
    variants = ["none", "fp16", "bf16", "powersgd-1", "powersgd-2", "powersgd-4", "powersgd-1-noef",
                "powersgd-2-noef"]
    return {"np": hvd.size(), "epochs": args.epochs, "seed": args.seed,
            "accuracy": {v: round(_digits(v, args.epochs, args.seed), 2) for v in variants}}


def main() -> None:
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    result = accuracy(args) if args.accuracy else step_times(args)
    if hvd.rank() == 0:
        if args.accuracy:
            for v, a in result["accuracy"].items():
                print(f"{v:18s} {a:6.2f} %")
        else:
            for v in result["median_ms"]:
                print(f"{v:12s} {result['median_ms'][v]:9.1f} ms  {result['bytes_per_step'][v] / 2**20:9.2f} MiB"
                      f"  time x{result['time_vs_none'].get(v, float('nan')):.2f}"
                      f"  bytes x{result['bytes_vs_none'].get(v, float('nan')):.4f}")
        print("PSGD_RESULT " + json.dumps(result), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
