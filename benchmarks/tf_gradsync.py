"""Gradient-set sync through horovod.tensorflow's DistributedGradientTape against raw MPI and the
PyTorch binding, in the same processes, interleaved (machine noise hits every mode alike).

    mpirun -np 2 python benchmarks/tf_gradsync.py --model resnet50

Modes (rank 0 prints one line per mode, then the ratios):
  mpi-flat    one mpi4py Allreduce of one float32 buffer of the gradients' total size, then /size
  tf-local    the tf.function step with a plain tf.GradientTape (computing the gradients only)
  tf-tape     the same step with hvd.DistributedGradientTape (gradients + averaging)
  tf-sync     tf-tape - tf-local: what averaging adds to the step
  torch-hvd   horovod.torch allreduce_async_ of each gradient, then synchronize (its optimizer path);
              skip with --no-torch
The step's loss is sum(reduce_sum(v)) over variables with the model's gradient shapes, so the
gradients are tensors of ones: computing them is cheap and the same in tf-local and tf-tape.
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
parser.add_argument("--model", default="resnet50", choices=sorted(MODELS))
parser.add_argument("--reps", type=int, default=20)
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--no-torch", action="store_true")
parser.add_argument("--json", default=None, help="write the medians here (rank 0)")


def main() -> None:
    args = parser.parse_args()
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    shapes = MODELS[args.model]()
    numel = sum(math.prod(s) for s in shapes)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    flat = np.ones(numel, np.float32)
    variables = [tf.Variable(tf.ones(s)) for s in shapes]

    def mpi_flat() -> None:
        comm.Allreduce(MPI.IN_PLACE, flat)
        np.divide(flat, size, out=flat)

    def make_step(distributed: bool):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(v) for v in variables])
            if distributed:
                tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, variables)
            return tf.add_n([g[(0,) * len(g.shape)] for g in grads])  # consume every gradient
        return lambda: step().numpy()

    modes = {"mpi-flat": mpi_flat, "tf-local": make_step(False), "tf-tape": make_step(True)}
    if not args.no_torch:
        try:
            import torch

            import horovod.torch as hvd_torch

            hvd_torch.init()
            torch.set_num_threads(1)
            tts = [torch.ones(s) for s in shapes]
            names = [f"g{i}" for i in range(len(tts))]

            def torch_hvd() -> None:
                hs = [hvd_torch.allreduce_async_(t, name=n, op=hvd_torch.Average) for t, n in zip(tts, names)]
                for h in hs:
                    hvd_torch.synchronize(h)

            modes["torch-hvd"] = torch_hvd
        except ImportError as exc:
            if rank == 0:
                print(f"torch path skipped: {exc}")
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.warmup):
        for fn in modes.values():
            fn()
    for _ in range(args.reps):
        for name, fn in modes.items():
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {m: statistics.median(t) * 1e3 for m, t in times.items()}
    med["tf-sync"] = med["tf-tape"] - med["tf-local"]
    # Machine noise comes in bursts; the ratio within one rep (modes run back to back) is steadier.
    ratio_med = statistics.median(t / f for t, f in zip(times["tf-tape"], times["mpi-flat"]))
    if rank == 0:
        print(f"model={args.model} np={size} tensors={len(shapes)} MiB={numel * 4 / 2**20:.1f} reps={args.reps}")
        for m in ["mpi-flat", "tf-local", "tf-tape", "tf-sync", "torch-hvd"]:
            if m in med:
                print(f"  {m:10s} median {med[m]:8.2f} ms")
        print(f"  ratio tf-tape / mpi-flat = {med['tf-tape'] / med['mpi-flat']:.2f} "
              f"(median of per-rep ratios {ratio_med:.2f})")
        print(f"  ratio tf-sync / mpi-flat = {med['tf-sync'] / med['mpi-flat']:.2f}")
        if "torch-hvd" in med:
            print(f"  ratio tf-tape / torch-hvd = {med['tf-tape'] / med['torch-hvd']:.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "np": size, "median_ms": med}, f, indent=1)


if __name__ == "__main__":
    main()
