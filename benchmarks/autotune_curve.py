"""Autotune curve: from the default knobs, how close does HOROVOD_AUTOTUNE get to an exhaustive grid?

Run (rank 0 writes benchmarks/results/autotune.json and autotune.png):

    mpirun -np 2 python benchmarks/autotune_curve.py                  # the synthetic ResNet
    mpirun -np 2 python benchmarks/autotune_curve.py --model mlp      # a 32 MiB MLP (communication-heavy)

One process group does everything, so the phases share the machine's state:
1. grid: every (fusion threshold, piece size, cycle time) of a grid, response cache on, is set on
   every rank between two barriers and timed for ``--grid-steps`` training steps (two passes, in
   opposite orders; the mean of the passes counts);
2. autotune: the knobs go back to the defaults and the engine's parameter manager (the one
   ``HOROVOD_AUTOTUNE=1`` installs) tunes them for ``--tune-steps`` steps with
   ``--steps-per-sample`` steps per sample and ``--warmup-samples`` warm-up samples;
3. check: the defaults, the grid's best and the autotuner's final choice are timed again,
   interleaved, ``--check-rounds`` times; the ratios of this phase are the result.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "pytorch"))
from pytorch_synthetic_benchmark import make_model  # noqa: E402

import horovod.torch as hvd  # noqa: E402
from horovod.common.autotune import ParameterManager  # noqa: E402
from horovod.common.context import get_context  # noqa: E402
from horovod.common.engine.observers import AutotuneObserver  # noqa: E402

MiB = 1024 * 1024
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default="resnet_small", help="resnet_small, resnet_tiny or mlp")
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--grid-steps", type=int, default=4)
parser.add_argument("--tune-steps", type=int, default=50)
parser.add_argument("--steps-per-sample", type=int, default=2)
parser.add_argument("--warmup-samples", type=int, default=1)
parser.add_argument("--max-samples", type=int, default=20)
parser.add_argument("--check-rounds", type=int, default=3)
parser.add_argument("--check-steps", type=int, default=6)
parser.add_argument("--out", default=os.path.join(HERE, "results", "autotune"))

GRID = {"fusion_threshold": [1 * MiB, 16 * MiB, 128 * MiB],
        "chunk_bytes": [256 * 1024, 2 * MiB, 16 * MiB],
        "cycle_time_ms": [1.0, 5.0]}
KNOBS = ("fusion_threshold", "chunk_bytes", "cycle_time_ms", "cache_enabled")


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if args.model == "mlp":  # 8 x (1024 x 1024) layers: 8.4 M parameters, 32 MiB of gradients
        model = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(1024, 1024), torch.nn.ReLU())])
        return model, torch.randn(args.batch_size, 1024), torch.randn(args.batch_size, 1024)
    model = make_model(args.model)
    return model, torch.randn(args.batch_size, 3, 32, 32), torch.randint(0, 1000, (args.batch_size,))


def main() -> None:
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    engine = get_context().engine
    model, data, target = build(args)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), 0)
    loss_fn = F.mse_loss if args.model == "mlp" else F.cross_entropy

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(data), target).backward()
        opt.step()
        return time.perf_counter() - t0

    def imgs(seconds: list[float]) -> float:  # images per second over the whole job
        return args.batch_size * size / statistics.mean(seconds)

    def apply(values: dict) -> None:
        hvd.barrier()
        engine.tunables.update(**values)
        hvd.barrier()

    def timed(values: dict, n: int) -> float:
        apply(values)
        step()
        return imgs([step() for _ in range(n)])

    defaults = {k: getattr(engine.tunables, k) for k in KNOBS}
    for _ in range(3):
        step()
    # 1. grid
    points = [dict(zip(GRID, v), cache_enabled=True) for v in itertools.product(*GRID.values())]
    passes = [[timed(p, args.grid_steps) for p in points],
              list(reversed([timed(p, args.grid_steps) for p in reversed(points)]))]
    grid = [{**p, "img_per_sec": statistics.mean(v)} for p, v in zip(points, zip(*passes))]
    grid_best = max(grid, key=lambda g: g["img_per_sec"])
    # 2. autotune from the defaults, with the engine's own parameter manager
    apply(defaults)
    log = args.out + ".csv"
    manager = ParameterManager(engine.tunables, rank, engine.backend.bcast_from_root, list(KNOBS),
                               warmup_samples=args.warmup_samples, steps_per_sample=args.steps_per_sample,
                               max_samples=args.max_samples, log_path=log if rank == 0 else "",
                               on_change=AutotuneObserver(None, engine.rounds).changed)
    hvd.barrier()
    engine._autotune = manager
    hvd.barrier()
    curve = []
    for i in range(args.tune_steps):
        seconds = step()
        curve.append({"step": i, "img_per_sec": args.batch_size * size / seconds,
                      **{k: getattr(engine.tunables, k) for k in KNOBS}})
    hvd.barrier()
    engine._autotune = None
    final = {k: v for k, v in (manager.history[-1] if manager.history and not manager.active else
                               {k: getattr(engine.tunables, k) for k in KNOBS}).items() if k in KNOBS}
    final = hvd.broadcast_object(final, 0, name="final")
    # 3. interleaved check
    check = {"defaults": [], "grid_best": [], "autotune_final": []}
    grid_values = {k: grid_best[k] for k in KNOBS}
    for _ in range(args.check_rounds):
        for label, values in (("defaults", defaults), ("grid_best", grid_values), ("autotune_final", final)):
            check[label].append(timed(values, args.check_steps))
    if rank != 0:
        return
    summary = {label: statistics.mean(v) for label, v in check.items()}
    result = {
        "command": f"mpirun -np {size} python benchmarks/autotune_curve.py --model {args.model}",
        "model": args.model, "np": size, "batch_size": args.batch_size, "defaults": defaults,
        "grid": grid, "grid_best": grid_best, "autotune_history": manager.history, "curve": curve,
        "final": final, "tuning_finished_within_steps": not manager.active,
        "check_img_per_sec": check, "check_mean": summary,
        "final_over_grid_best": summary["autotune_final"] / summary["grid_best"],
        "defaults_over_grid_best": summary["defaults"] / summary["grid_best"],
    }
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.out + ".png")
    print(json.dumps({k: result[k] for k in ("model", "np", "final", "final_over_grid_best",
                                              "defaults_over_grid_best", "check_mean")}))


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [c["step"] for c in result["curve"]]
    speed = [c["img_per_sec"] for c in result["curve"]]
    a.plot(steps, speed, ".-", lw=0.8, label="autotune run (per step)")
    a.axhline(result["grid_best"]["img_per_sec"], color="g", ls="--", label="grid best")
    a.axhline(0.9 * result["grid_best"]["img_per_sec"], color="g", ls=":", label="90% of grid best")
    a.set_xlabel("training step")
    a.set_ylabel("images / s (all ranks)")
    a.set_title(f"{result['model']}, np={result['np']}")
    a.legend(fontsize=8)
    hist = [h for h in result["autotune_history"] if h["phase"] == "sample"]
    scores = [h["score"] for h in hist]
    b.plot(range(len(scores)), scores, "o", label="sample score (bytes/us)")
    b.plot(range(len(scores)), [max(scores[:i + 1]) for i in range(len(scores))], "-", label="best so far")
    b.set_xlabel("autotune sample")
    b.set_ylabel("score")
    b.set_title(f"final / grid best = {result['final_over_grid_best']:.2f} (interleaved check)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
