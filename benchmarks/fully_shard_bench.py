"""hvd.fully_shard against hvd.DistributedOptimizer, ZeRO stages 1 and 2 and torch's own FSDP2
(``fully_shard`` on a Gloo process group): peak memory per rank, step time (interleaved, same
run) and the bytes each rank sends, on CPU.

    python benchmarks/fully_shard_bench.py                  # 24 x Linear(2048, 2048): 100.7 M parameters
    python benchmarks/fully_shard_bench.py --np 2 --mem-np 4 --layers 24 --width 2048 --reps 5

The model is ``--layers`` blocks of ``Linear(width, width)`` (each block wrapped, then the root, for
both fully sharded variants; each block is built and wrapped before the next is built, so no rank
ever holds the whole model), fp32 AdamW, a batch of ``--batch`` rows, loss ``out.square().mean()``.

Memory: each variant runs in its own launch of ``--mem-np`` ranks; per rank: ``base``, the RSS once
Horovod and a Gloo process group are up but before the model exists; a warm-up step allocates the
optimizer state; then the kernel's peak-RSS counter is reset (``echo 5 > /proc/self/clear_refs``)
and after one more step ``VmHWM`` is read: the step's peak, reported absolute and above ``base``
(the import floor). Bytes sent are not measured (``wchar`` of ``/proc/self/io`` counts none of
Horovod's MPI sends); docs/fully_shard.md gives each variant's per-rank bytes from its collectives.

``--malloc-mmap-threshold BYTES`` sets glibc's ``MALLOC_MMAP_THRESHOLD_`` for every rank of every
variant: allocations from that size on are mapped and unmapped, not carved from the heap. Without
it glibc raises its threshold to the largest block freed so far (up to 32 MiB), so a sharded
model's per-block buffers (16 MiB here) come from the heap, whose freed holes stay resident
(docs/fully_shard.md, "Memory").

Time: one launch of ``--np`` ranks holds every variant and times their steps interleaved in a
rotating order, ``--reps`` times each (after a warm-up round); medians of the slowest rank per
step, and ratios to DistributedOptimizer.

Writes benchmarks/results/fully_shard.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

VARIANTS = ("distributed", "zero1", "zero2", "fully_shard", "fsdp2")


def _rss_now() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _status(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


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


def _build(variant: str, cfg: dict[str, Any], mesh: Any) -> tuple[Any, Any]:
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
    if variant in ("zero1", "zero2"):
        return model, hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                                  stage=int(variant[-1]), lr=1e-4,
                                                  named_parameters=model.named_parameters())
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


def _memory(variant: str, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    mesh = _gloo()  # every variant: the same floor
    rss_base = _status("VmRSS")
    model, opt = _build(variant, cfg, mesh)
    x = torch.randn(cfg["batch"], cfg["width"])
    _step(model, opt, x)  # the optimizer's state
    hvd.barrier()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    _step(model, opt, x)
    peak = _status("VmHWM")
    return {"rank": hvd.rank(), "rss_base": rss_base, "peak_rss": peak, "peak_above_base": peak - rss_base}


def _timing(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    mesh = _gloo()
    variants: tuple[str, ...] = tuple(cfg["variants"])
    runs = {v: _build(v, cfg, mesh) for v in variants}
    x = torch.randn(cfg["batch"], cfg["width"])
    times: dict[str, list[float]] = {v: [] for v in variants}
    for rep in range(cfg["reps"] + 1):  # the first round warms up
        k = rep % len(variants)
        order = variants[k:] + variants[:k]
        for v in order:
            hvd.barrier()
            t0 = time.perf_counter()
            _step(*runs[v], x)
            dt = time.perf_counter() - t0
            if rep:
                times[v].append(dt)
    # the three trained the same weights from the same start (a check, not a figure)
    diff = 0.0
    if "fully_shard" in runs and "distributed" in runs:
        full = runs["fully_shard"][0].full_state_dict()
        ref = runs["distributed"][0].state_dict()
        diff = max(float((full[k] - v).abs().max()) for k, v in ref.items())
    return {"rank": hvd.rank(), "times": times, "max_weight_difference": diff}


def _write(path: str, out: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2, help="ranks of the timing launch (0: none)")
    parser.add_argument("--mem-np", type=int, default=4, help="ranks of each memory launch (0: none)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=None,
                        help="MALLOC_MMAP_THRESHOLD_ for every rank (bytes)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results", "fully_shard.json"))
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from horovod.testing import run_ranks

    variants = tuple(v for v in VARIANTS if v in args.variants.split(","))
    env = {} if args.malloc_mmap_threshold is None else {
        "MALLOC_MMAP_THRESHOLD_": str(args.malloc_mmap_threshold)}
    cfg = {"layers": args.layers, "width": args.width, "batch": args.batch, "reps": args.reps,
           "variants": variants}
    psi = args.layers * (args.width * args.width + args.width)
    mib = 2.0 ** 20
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) = {psi / 1e6:.1f} M parameters, "
          f"fp32 AdamW, batch {args.batch}; environment {env or 'as is'}")
    load_start = os.getloadavg()
    print(f"load average at the start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}")
    out: dict[str, Any] = {"config": cfg, "np": args.np, "mem_np": args.mem_np, "parameters": psi,
                           "environment": env}
    ref = "distributed" if "distributed" in variants else variants[0]
    if args.mem_np:
        memory = {}
        for v in variants:
            memory[v] = run_ranks(_memory, np=args.mem_np, args=(v, cfg), timeout=3600, env=env)
            w = memory[v]
            print(f"  {v:<12} peak {max(r['peak_rss'] for r in w) / mib:7.0f} MiB, above the floor "
                  f"{max(r['peak_above_base'] for r in w) / mib:7.0f} MiB (floor "
                  f"{max(r['rss_base'] for r in w) / mib:.0f})", flush=True)
        out["memory"] = memory
        worst = {v: max(r["peak_rss"] for r in memory[v]) for v in variants}
        above = {v: max(r["peak_above_base"] for r in memory[v]) for v in variants}
        out["peak_rss_ratio"] = {v: worst[v] / worst[ref] for v in variants}
        out["peak_above_base_ratio"] = {v: above[v] / above[ref] for v in variants}
        print(f"peak per rank at np={args.mem_np}, worst rank, ratio to {ref}:")
        for v in variants:
            print(f"  {v:<12} absolute x{out['peak_rss_ratio'][v]:.3f}   above the floor "
                  f"x{out['peak_above_base_ratio'][v]:.3f}")
        _write(args.out, out)  # a timing launch that does not finish keeps the memory figures
    if args.np:
        timing = run_ranks(_timing, np=args.np, args=(cfg,), timeout=3600, env=env)
        med = {v: statistics.median(max(t["times"][v][i] for t in timing) for i in range(args.reps))
               for v in variants}
        out["median_step_s"] = med
        out["time_ratio"] = {v: med[v] / med[ref] for v in variants}
        out["max_weight_difference"] = max(t["max_weight_difference"] for t in timing)
        print(f"\nstep time at np={args.np} (median of {args.reps}, slowest rank per step), interleaved:")
        for v in variants:
            line = f"  {v:<12}{med[v]:8.3f} s   x{med[v] / med[ref]:.3f} of {ref}"
            if "fsdp2" in med:
                line += f"   x{med[v] / med['fsdp2']:.3f} of fsdp2"
            print(line)
        print(f"fully_shard's weights vs DistributedOptimizer's after the same steps: max difference "
              f"{out['max_weight_difference']:.2e}")
    out["load_average"] = {"start": load_start, "end": os.getloadavg()}
    _write(args.out, out)
    print(f"load average at the end: {out['load_average']['end']}")
    print(f"written: {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
