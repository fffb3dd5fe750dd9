"""hvd.fully_shard against hvd.DistributedOptimizer and torch's own FSDP2 (``fully_shard`` on a
Gloo process group): step time (interleaved, same run) and peak RSS per rank, on CPU.

    python benchmarks/fully_shard_bench.py                  # 24 x Linear(2048, 2048): 100.7 M parameters
    python benchmarks/fully_shard_bench.py --np 2 --mem-np 4 --layers 24 --width 2048 --reps 5

The model is ``--layers`` blocks of ``Linear(width, width)`` (each block wrapped, then the root, for
both fully sharded variants; each block is built and wrapped before the next is built, so no rank
ever holds the whole model), fp32 AdamW, a batch of ``--batch`` rows, loss ``out.square().mean()``.

Memory: each variant runs in its own launch of ``--mem-np`` ranks and takes ``--mem-steps`` steps;
per rank: the RSS once Horovod (and, for FSDP2, the process group) is up but before the model
exists, and the process's peak RSS (``ru_maxrss``). Time: one launch of ``--np`` ranks holds the
three models and times their steps interleaved in a rotating order, ``--reps`` times each (after a
warm-up round); medians of the slowest rank per step, and ratios to DistributedOptimizer.

Writes benchmarks/results/fully_shard.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

VARIANTS = ("distributed", "fully_shard", "fsdp2")


def _rss_now() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _gloo() -> Any:
    """A Gloo process group over the same ranks (for FSDP2) and its device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import horovod.torch as hvd

    if not dist.is_initialized():
        port = hvd.broadcast_object(20000 + os.getpid() % 20000, root_rank=0)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=hvd.rank(), world_size=hvd.size())
    return init_device_mesh("cpu", (hvd.size(),))


def _build(variant: str, cfg: dict[str, int], mesh: Any) -> tuple[Any, Any]:
    import torch

    import horovod.torch as hvd

    blocks = []
    for i in range(cfg["layers"]):
        torch.manual_seed(i)
        b = torch.nn.Linear(cfg["width"], cfg["width"])
        if variant == "fully_shard":
            hvd.fully_shard(b)
        elif variant == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            fully_shard(b, mesh=mesh)
        blocks.append(b)
    model = torch.nn.Sequential(*blocks)
    if variant == "distributed":
        opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4),
                                       named_parameters=model.named_parameters())
        return model, opt
    if variant == "fully_shard":
        hvd.fully_shard(model)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model: Any, opt: Any, x: Any) -> None:
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _memory(variant: str, cfg: dict[str, int]) -> dict[str, Any]:
    import resource

    import torch

    import horovod.torch as hvd

    hvd.init()
    mesh = _gloo() if variant == "fsdp2" else None
    rss_base = _rss_now()
    model, opt = _build(variant, cfg, mesh)
    x = torch.randn(cfg["batch"], cfg["width"])
    for _ in range(cfg["mem_steps"]):
        _step(model, opt, x)
    return {"rank": hvd.rank(), "rss_base": rss_base,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _timing(cfg: dict[str, int]) -> dict[str, Any]:
    import torch

    import horovod.torch as hvd

    hvd.init()
    mesh = _gloo()
    runs = {v: _build(v, cfg, mesh) for v in VARIANTS}
    x = torch.randn(cfg["batch"], cfg["width"])
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(cfg["reps"] + 1):  # the first round warms up
        order = VARIANTS[rep % 3:] + VARIANTS[:rep % 3]
        for v in order:
            hvd.barrier()
            t0 = time.perf_counter()
            _step(*runs[v], x)
            dt = time.perf_counter() - t0
            if rep:
                times[v].append(dt)
    # the three trained the same weights from the same start (a check, not a figure)
    full = runs["fully_shard"][0].full_state_dict()
    ref = runs["distributed"][0].state_dict()
    diff = max(float((full[k] - v).abs().max()) for k, v in ref.items())
    return {"rank": hvd.rank(), "times": times, "max_weight_difference": diff}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2, help="ranks of the timing launch")
    parser.add_argument("--mem-np", type=int, default=4, help="ranks of each memory launch")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--mem-steps", type=int, default=2)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results", "fully_shard.json"))
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from horovod.testing import run_ranks

    cfg = {"layers": args.layers, "width": args.width, "batch": args.batch, "reps": args.reps,
           "mem_steps": args.mem_steps}
    psi = args.layers * (args.width * args.width + args.width)
    mib = 2.0 ** 20
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) = {psi / 1e6:.1f} M parameters, "
          f"fp32 AdamW, batch {args.batch}")
    load_start = os.getloadavg()
    print(f"load average at the start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}")
    out: dict[str, Any] = {"config": cfg, "np": args.np, "mem_np": args.mem_np, "parameters": psi}
    if not args.skip_memory:
        memory = {v: run_ranks(_memory, np=args.mem_np, args=(v, cfg), timeout=3600) for v in VARIANTS}
        out["memory"] = memory
        print(f"\npeak RSS per rank at np={args.mem_np} (MiB; 'model' = peak minus the RSS before the model):")
        worst = {v: max(r["peak_rss"] for r in memory[v]) for v in VARIANTS}
        worst_model = {v: max(r["peak_rss"] - r["rss_base"] for r in memory[v]) for v in VARIANTS}
        for v in VARIANTS:
            print(f"  {v:<12} peak {worst[v] / mib:9.1f} (x{worst[v] / worst['distributed']:.3f})   "
                  f"model {worst_model[v] / mib:9.1f} (x{worst_model[v] / worst_model['distributed']:.3f})")
        out["peak_rss_ratio"] = {v: worst[v] / worst["distributed"] for v in VARIANTS}
        out["model_rss_ratio"] = {v: worst_model[v] / worst_model["distributed"] for v in VARIANTS}
    if not args.skip_timing:
        timing = run_ranks(_timing, np=args.np, args=(cfg,), timeout=3600)
        med = {v: statistics.median(max(t["times"][v][i] for t in timing) for i in range(args.reps))
               for v in VARIANTS}
        out["median_step_s"] = med
        out["time_ratio"] = {v: med[v] / med["distributed"] for v in VARIANTS}
        out["max_weight_difference"] = max(t["max_weight_difference"] for t in timing)
        print(f"\nstep time at np={args.np} (median of {args.reps}, slowest rank per step), interleaved:")
        for v in VARIANTS:
            print(f"  {v:<12}{med[v]:8.3f} s   x{med[v] / med['distributed']:.3f} of distributed   "
                  f"x{med[v] / med['fsdp2']:.3f} of fsdp2")
        print(f"fully_shard's weights vs DistributedOptimizer's after the same steps: max difference "
              f"{out['max_weight_difference']:.2e}")
    out["load_average"] = {"start": load_start, "end": os.getloadavg()}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"load average at the end: {out['load_average']['end']}")
    print(f"written: {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
