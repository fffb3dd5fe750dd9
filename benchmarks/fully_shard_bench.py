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
(the import floor).

``--malloc-mmap-threshold BYTES`` sets glibc's ``MALLOC_MMAP_THRESHOLD_`` for every rank of every
variant: allocations from that size on are mapped and unmapped, not carved from the heap. Without
it glibc raises its threshold to the largest block freed so far (up to 32 MiB), so a sharded
model's per-block buffers (16 MiB here) come from the heap, whose freed holes stay resident
(docs/fully_shard.md, "Memory").

``--mem-time-steps K`` also times K more steps in each memory launch (the variant alone in its
processes: no other variant's memory for its allocator to release or fault in again).

Time: one launch of ``--np`` ranks holds every variant and times their steps interleaved in a
rotating order, ``--reps`` times each (after a warm-up round); medians of the slowest rank per
step, and ratios to DistributedOptimizer (and FSDP2): of the medians, and the median of the ratios
within each round (``paired_ratio``: the variants of a round ran one after the other, so a load that
changes over minutes moves them together). Besides the five default variants, ``--variants`` may
name ``fully_shard_keep`` and ``fsdp2_keep`` (``reshard_after_forward=False``),
``fully_shard_norelease`` (``hvd.fully_shard`` without handing freed memory back to the kernel
after each module, ``HOROVOD_FULLY_SHARD_RELEASE_MEMORY=0``), ``local`` (the
same step with no collective: the compute floor) and the wire floors, each variant's raw
collectives on buffers of its bytes with no compute, every collective of a phase started at once
(the wire's best case): ``floor_allreduce`` (one allreduce per block's gradients,
DistributedOptimizer's), ``floor_fully_shard`` (per block an allgather in forward, one more and a
reduce-scatter in backward) and ``floor_fully_shard_keep`` (no second allgather).

Bytes sent: the warm-up round counts, per rank and variant, the bytes of each kind of collective
that Horovod's engine ran (``hvd.metrics()``) and turns them into what ring algorithms put on the
wire (allreduce 2(n-1)/n of its input, allgather n-1 times its input, reduce-scatter (n-1)/n); for
FSDP2 (Gloo sockets, not Horovod) what the process wrote (``wchar`` of /proc/self/io).

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

VARIANTS = ("distributed", "zero1", "zero2", "fully_shard", "fsdp2", "fully_shard_keep", "fsdp2_keep",
            "fully_shard_norelease",
            "local", "floor_allreduce", "floor_fully_shard", "floor_fully_shard_keep")
# the step without any collective (compute floor), and the raw collectives of each variant's
# bytes without compute (wire floor): only in the timing launch
FLOORS = ("local", "floor_allreduce", "floor_fully_shard", "floor_fully_shard_keep")
DEFAULT = ("distributed", "zero1", "zero2", "fully_shard", "fsdp2")


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

    keep = variant.endswith("_keep")  # reshard_after_forward=False
    blocks = []
    for i in range(cfg["layers"]):
        torch.manual_seed(i)
        b = torch.nn.Linear(cfg["width"], cfg["width"])
        if variant.startswith("fully_shard"):
            hvd.fully_shard(b, reshard_after_forward=not keep)
        elif variant.startswith("fsdp2"):
            from torch.distributed.fsdp import fully_shard

            fully_shard(b, mesh=mesh, reshard_after_forward=not keep)
        blocks.append(b)
    model = torch.nn.Sequential(*blocks)
    if variant == "local":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    if variant == "distributed":
        opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4),
                                       named_parameters=model.named_parameters())
        return model, opt
    if variant in ("zero1", "zero2"):
        return model, hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                                  stage=int(variant[-1]), lr=1e-4,
                                                  named_parameters=model.named_parameters())
    if variant.startswith("fully_shard"):
        hvd.fully_shard(model)
        if variant == "fully_shard_norelease":  # the C allocator's free pages kept (no malloc_trim)
            for m in model.modules():
                if isinstance(m, hvd.FullyShardedModule):
                    m._groups()[0].release_memory = False
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model: Any, opt: Any, x: Any) -> None:
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _floor(variant: str, cfg: dict[str, Any]) -> Any:
    """A step of ``variant``'s raw collectives on buffers of its bytes, no compute: one allreduce
    per block's gradients (``floor_allreduce``, DistributedOptimizer's); per block an allgather of
    its per-rank segment in forward, again in backward, and a reduce-scatter of the whole block
    (``floor_fully_shard``; ``_keep``: no second allgather). Each phase's collectives are started
    together, then waited for: the wire's best case for those bytes."""
    import torch

    import horovod.torch as hvd

    n, w, layers = hvd.size(), cfg["width"], cfg["layers"]
    block = w * w + w
    seg = -(-w // n) * w + -(-w // n)  # fully_shard's per-rank segment: ceil(rows/n) rows of each
    grads = [torch.ones(block) for _ in range(layers)]
    shards = [torch.ones(seg) for _ in range(layers)]
    full = [torch.ones(n * seg) for _ in range(layers)]

    def run() -> None:
        if variant == "floor_allreduce":
            hs = [hvd.allreduce_async(g, op=hvd.Average, name=f"floor.ar.{i}") for i, g in enumerate(grads)]
        else:
            if variant == "floor_fully_shard":
                for h in [hvd.allgather_async(s, name=f"floor.fwd.{i}") for i, s in enumerate(shards)]:
                    hvd.synchronize(h)
            hs = [hvd.allgather_async(s, name=f"floor.bwd.{i}") for i, s in enumerate(shards)]
            hs += [hvd.reducescatter_async(f, op=hvd.Average, name=f"floor.rs.{i}") for i, f in enumerate(full)]
        for h in hs:
            hvd.synchronize(h)
    return run


def _sent(variant: str, before: dict[str, Any], after: dict[str, Any], io: int, n: int) -> dict[str, float]:
    """Bytes this rank put on the wire in one step, from the collectives' bytes that Horovod's
    engine counted (``hvd.metrics()``), as ring algorithms send them: an allreduce 2(n-1)/n of
    its input, an allgather (n-1) times its input (each rank's part to every other), a
    reduce-scatter (n-1)/n of its input; FSDP2 (Gloo, not Horovod): what its sockets wrote
    (``wchar`` of /proc/self/io)."""
    if variant.startswith("fsdp2"):
        return {"wire": float(io)}
    got = {k: after["collective_bytes"].get(k, 0) - before["collective_bytes"].get(k, 0)
           for k in after["collective_bytes"]}
    factor = {"allreduce": 2 * (n - 1) / n, "allgather": float(n - 1), "reducescatter": (n - 1) / n}
    out = {k: float(v) for k, v in got.items() if v}
    out["wire"] = sum(v * factor.get(k.lower(), 1.0) for k, v in got.items())
    return out


def _wchar() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


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
    times = []
    for _ in range(cfg.get("mem_time_steps", 0)):  # this variant alone in its launch
        hvd.barrier()
        t0 = time.perf_counter()
        _step(model, opt, x)
        times.append(time.perf_counter() - t0)
    return {"rank": hvd.rank(), "rss_base": rss_base, "peak_rss": peak, "peak_above_base": peak - rss_base,
            "step_times": times}


def _timing(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    mesh = _gloo()
    variants: tuple[str, ...] = tuple(cfg["variants"])
    x = torch.randn(cfg["batch"], cfg["width"])
    steps = {}
    for v in variants:
        if v.startswith("floor_"):
            steps[v] = _floor(v, cfg)
        else:
            model, opt = _build(v, cfg, mesh)
            steps[v] = lambda model=model, opt=opt: _step(model, opt, x)
            steps[v].model = model  # type: ignore[attr-defined]
    times: dict[str, list[float]] = {v: [] for v in variants}
    sent: dict[str, dict[str, float]] = {}
    for rep in range(cfg["reps"] + 1):  # the first round warms up
        k = rep % len(variants)
        order = variants[k:] + variants[:k]
        for v in order:
            hvd.barrier()
            before, io = hvd.metrics(), _wchar()
            t0 = time.perf_counter()
            steps[v]()
            dt = time.perf_counter() - t0
            if rep:
                times[v].append(dt)
            else:
                sent[v] = _sent(v, before, hvd.metrics(), _wchar() - io, hvd.size())
    # the three trained the same weights from the same start (a check, not a figure)
    diff = 0.0
    if "fully_shard" in steps and "distributed" in steps:
        full = steps["fully_shard"].model.full_state_dict()  # type: ignore[attr-defined]
        ref = steps["distributed"].model.state_dict()  # type: ignore[attr-defined]
        diff = max(float((full[k] - v).abs().max()) for k, v in ref.items())
    return {"rank": hvd.rank(), "times": times, "max_weight_difference": diff, "sent": sent}


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
    parser.add_argument("--mem-time-steps", type=int, default=0,
                        help="after the memory step, time this many steps in each variant's own launch")
    parser.add_argument("--variants", default=",".join(DEFAULT),
                        help=f"comma-separated, of {','.join(VARIANTS)} (the floors: timing only)")
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
           "variants": variants, "mem_time_steps": args.mem_time_steps}
    psi = args.layers * (args.width * args.width + args.width)
    mib = 2.0 ** 20
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) = {psi / 1e6:.1f} M parameters, "
          f"fp32 AdamW, batch {args.batch}; environment {env or 'as is'}")
    load_start = os.getloadavg()
    print(f"load average at the start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}")
    out: dict[str, Any] = {"config": cfg, "np": args.np, "mem_np": args.mem_np, "parameters": psi,
                           "environment": env}
    ref = "distributed" if "distributed" in variants else variants[0]
    if args.mem_np and not [v for v in variants if v not in FLOORS]:
        args.mem_np = 0  # only floors: nothing to measure the memory of
    if args.mem_np:
        memory = {}
        for v in (v for v in variants if v not in FLOORS):
            memory[v] = run_ranks(_memory, np=args.mem_np, args=(v, cfg), timeout=3600, env=env)
            w = memory[v]
            steps = [max(r["step_times"][i] for r in w) for i in range(args.mem_time_steps)]
            line = f", step {statistics.median(steps):.3f} s (median of {len(steps)})" if steps else ""
            print(f"  {v:<12} peak {max(r['peak_rss'] for r in w) / mib:7.0f} MiB, above the floor "
                  f"{max(r['peak_above_base'] for r in w) / mib:7.0f} MiB (floor "
                  f"{max(r['rss_base'] for r in w) / mib:.0f}){line}; load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
        out["memory"] = memory
        worst = {v: max(r["peak_rss"] for r in memory[v]) for v in memory}
        above = {v: max(r["peak_above_base"] for r in memory[v]) for v in memory}
        out["peak_rss_ratio"] = {v: worst[v] / worst[ref] for v in memory}
        out["peak_above_base_ratio"] = {v: above[v] / above[ref] for v in memory}
        print(f"peak per rank at np={args.mem_np}, worst rank, ratio to {ref}:")
        for v in memory:
            print(f"  {v:<12} absolute x{out['peak_rss_ratio'][v]:.3f}   above the floor "
                  f"x{out['peak_above_base_ratio'][v]:.3f}")
        _write(args.out, out)  # a timing launch that does not finish keeps the memory figures
    if args.np:
        timing = run_ranks(_timing, np=args.np, args=(cfg,), timeout=3600, env=env)
        steps = {v: [max(t["times"][v][i] for t in timing) for i in range(args.reps)] for v in variants}
        med = {v: statistics.median(steps[v]) for v in variants}
        out["step_s"] = steps
        out["median_step_s"] = med
        out["time_ratio"] = {v: med[v] / med[ref] for v in variants}
        # each round runs every variant once, one after the other: the ratio within a round, whose
        # variants ran minutes apart at most, is less exposed to the load than a ratio of medians
        paired = {v: {w: statistics.median(steps[v][i] / steps[w][i] for i in range(args.reps))
                      for w in (ref, "fsdp2") if w in steps} for v in variants}
        out["paired_ratio"] = paired
        out["max_weight_difference"] = max(t["max_weight_difference"] for t in timing)
        print(f"\nstep time at np={args.np} (median of {args.reps}, slowest rank per step), interleaved:")
        for v in variants:
            line = f"  {v:<22}{med[v]:8.3f} s   x{med[v] / med[ref]:.3f} of {ref}"
            if "fsdp2" in med:
                line += f"   x{med[v] / med['fsdp2']:.3f} of fsdp2"
            line += "   (within a round: " + ", ".join(f"x{x:.3f} of {w}" for w, x in paired[v].items()) + ")"
            print(line)
        print(f"fully_shard's weights vs DistributedOptimizer's after the same steps: max difference "
              f"{out['max_weight_difference']:.2e}")
        out["sent"] = {v: max((t["sent"][v] for t in timing), key=lambda d: d["wire"]) for v in variants}
        print(f"\nbytes sent per rank in a step (largest rank; ring algorithms over the bytes the engine "
              f"counted; FSDP2: its sockets' writes), P = {4 * psi / 1e6:.1f} MB of parameters:")
        for v in variants:
            d = out["sent"][v]
            parts = ", ".join(f"{k} {b / 1e6:.1f} MB in" for k, b in d.items() if k != "wire")
            print(f"  {v:<22}{d['wire'] / 1e6:9.1f} MB  = {d['wire'] / (4 * psi):.3f} P   ({parts})")
    out["load_average"] = {"start": load_start, "end": os.getloadavg()}
    _write(args.out, out)
    print(f"load average at the end: {out['load_average']['end']}")
    print(f"written: {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
