"""ZeroRedundancyOptimizer (stage 1, stage 2) against DistributedOptimizer: memory per rank, step
time and bytes on the wire, for a synthetic model of at least 100 M parameters on CPU.

    python benchmarks/zero_memory.py                      # np=2, 24 x Linear(2048, 2048), AdamW
    python benchmarks/zero_memory.py --np 2 --layers 24 --width 2048 --reps 6 --batch 16

Memory: each variant runs in its own launch of ``--np`` ranks (so that each process's peak RSS
belongs to one variant): it builds the model, takes ``--mem-steps`` AdamW steps and reports, per
rank, the optimizer-state bytes, the gradient bytes held after the reduction, and the process's
peak RSS (``ru_maxrss``) and its RSS before the optimizer existed. Expected figures are ZeRO's
model-state formulas for fp32 AdamW (K = 8 bytes of state per parameter, Psi parameters, N ranks):
DistributedOptimizer 4Psi + 4Psi + 8Psi, stage 1 4Psi + 4Psi + 8Psi/N, stage 2 4Psi + 4Psi/N + 8Psi/N
(parameters + gradients after reduction + optimizer state).

Time: one more launch holds one model and the three optimizers (only the active one's gradient
hooks are registered) and times their steps interleaved, in a rotating order, ``--reps`` times
each; medians and ratios to DistributedOptimizer are printed. Bytes on the wire: the payload of
every collective the engine hands to the transport is recorded during each variant's steps and
converted to what one rank sends in a ring algorithm (allreduce 2(N-1)/N x B, reduce-scatter,
alltoall and allgather (N-1)/N x B of the whole buffer). Another launch times the schedules a
reduce-scatter of one ``--transport-mib`` buffer can take (allreduce of the buffer, the transport's
reduce-scatter, alltoall plus a local sum: stage 2 uses the last), interleaved. A last launch
times how long ``hvd.checkpoint.save`` holds the loop, blocking and not (interleaved,
``--ckpt-reps`` each).

Writes benchmarks/results/zero_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

VARIANTS = ("distributed", "zero1", "zero2")


def _model(layers: int, width: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _optimizer(variant: str, model: Any) -> Any:
    import torch

    import horovod.torch as hvd

    if variant == "distributed":
        return hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4),
                                        named_parameters=model.named_parameters())
    return hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                       stage=int(variant[-1]), lr=1e-4,
                                       named_parameters=model.named_parameters())


def _state_bytes(opt: Any) -> int:
    import torch

    import horovod.torch as hvd

    state = opt.optim.state if isinstance(opt, hvd.ZeroRedundancyOptimizer) else opt.state
    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def _rss_now() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory(variant: str, cfg: dict[str, int]) -> dict[str, Any]:
    import resource

    import torch

    import horovod.torch as hvd

    hvd.init()
    model = _model(cfg["layers"], cfg["width"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.randn(cfg["batch"], cfg["width"])
    rss_before = _rss_now()
    opt = _optimizer(variant, model)
    grad_bytes = 0
    for _ in range(cfg["mem_steps"]):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.synchronize()
        grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                         if p.grad is not None)
        with opt.skip_synchronize():
            opt.step()
    return {"rank": hvd.rank(), "state_bytes": _state_bytes(opt), "grad_bytes": grad_bytes,
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "largest_param_bytes": max(p.numel() * p.element_size() for p in model.parameters()),
            "rss_before_optimizer": rss_before,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


class _Wire:
    """Records the payload the engine hands to the transport, per variant."""

    def __init__(self, backend: Any, n: int) -> None:
        self.n, self.current, self.bytes = n, "", {v: 0.0 for v in VARIANTS}
        ring = (n - 1) / n
        for name, factor, arg in (("allreduce", 2 * ring, 0), ("reducescatter", ring, 0),
                                  ("allgatherv", ring, 1), ("alltoallv", ring, 0)):
            original = getattr(backend, name)
            setattr(backend, name, self._wrap(original, factor, arg))

    def _wrap(self, original: Any, factor: float, arg: int) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.current:
                self.bytes[self.current] += factor * args[arg].nbytes
            return original(*args, **kwargs)
        return call


def _hooks(opt: Any, on: bool) -> None:
    from horovod.torch.reducer import reducer_of

    reducer = reducer_of(opt)
    if reducer is None:
        return
    reducer.remove_hooks()
    if on:
        reducer.register_hooks()


def _timing(cfg: dict[str, int]) -> dict[str, Any]:
    import torch

    import horovod.torch as hvd
    from horovod.common.context import get_context

    hvd.init()
    model = _model(cfg["layers"], cfg["width"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.randn(cfg["batch"], cfg["width"])
    opts = {v: _optimizer(v, model) for v in VARIANTS}
    if cfg["stage2_schedule"] != "auto":
        opts["zero2"].reduce_schedule = cfg["stage2_schedule"]
    for opt in opts.values():
        _hooks(opt, False)
    # stage 2's schedule "auto" times its two reduce-scatter schedules over its first 4 steps
    _hooks(opts["zero2"], True)
    for _ in range(4):
        opts["zero2"].zero_grad()
        model(x).square().mean().backward()
        opts["zero2"].step()
    _hooks(opts["zero2"], False)
    wire = _Wire(get_context().backend, hvd.size())
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(cfg["reps"] + 1):  # the first round warms up
        order = VARIANTS[rep % 3:] + VARIANTS[:rep % 3]
        for v in order:
            opt = opts[v]
            _hooks(opt, True)
            hvd.barrier()
            wire.current = v if rep else ""
            t0 = time.perf_counter()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            dt = time.perf_counter() - t0
            wire.current = ""
            _hooks(opt, False)
            if rep:
                times[v].append(dt)
    return {"rank": hvd.rank(), "times": times, "zero2_schedule": opts["zero2"].chosen_schedule,
            "zero2_trial_s": opts["zero2"].reducer.trial_times,
            "wire_bytes_per_step": {v: b / cfg["reps"] for v, b in wire.bytes.items()}}


def _transports(mib: int, reps: int) -> dict[str, list[float]]:
    """One reduce-scatter of a ``mib`` MiB fp32 buffer, three schedules, interleaved."""
    import torch

    import horovod.torch as hvd

    hvd.init()
    n = hvd.size()
    x = torch.randn(n, (mib << 18) // n)  # mib MiB of fp32
    work = x.clone()

    def allreduce() -> None:
        work.copy_(x)
        hvd.allreduce_(work, name="t.allreduce", op=hvd.Sum)

    def reducescatter() -> None:
        hvd.reducescatter(x, name="t.reducescatter", op=hvd.Sum)

    def alltoall_sum() -> None:
        out = hvd.alltoall(x.view(-1), name="t.alltoall")
        out.view(n, -1).sum(0)

    variants = {"allreduce": allreduce, "reducescatter": reducescatter, "alltoall+sum": alltoall_sum}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for rep in range(reps + 1):
        for k, fn in variants.items():
            hvd.barrier()
            t0 = time.perf_counter()
            fn()
            if rep:
                times[k].append(time.perf_counter() - t0)
    return times


def _checkpoint(cfg: dict[str, int], root: str) -> dict[str, Any]:
    """How long ``hvd.checkpoint.save`` holds the training loop: blocking, and non-blocking (until
    it returns; the files are written while the next steps run, then ``wait()``), interleaved."""
    import shutil

    import torch

    import horovod.torch as hvd

    hvd.init()
    model = _model(cfg["layers"], cfg["width"])
    x = torch.randn(cfg["batch"], cfg["width"])
    opt = _optimizer("zero1", model)
    out: dict[str, list[float]] = {"blocking": [], "non_blocking": [], "wait": []}
    for rep in range(cfg["ckpt_reps"]):
        for mode in ("blocking", "non_blocking") if rep % 2 == 0 else ("non_blocking", "blocking"):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            path = os.path.join(root, mode)
            hvd.barrier()
            t0 = time.perf_counter()
            handle = hvd.checkpoint.save(path, model=model, optimizer=opt, blocking=mode == "blocking")
            out[mode].append(time.perf_counter() - t0)
            if mode == "non_blocking":
                opt.zero_grad()
                model(x).square().mean().backward()  # training goes on meanwhile
                opt.step()
                t1 = time.perf_counter()
                handle.wait()
                out["wait"].append(time.perf_counter() - t1)
            hvd.barrier()
            if hvd.rank() == 0:
                shutil.rmtree(path, ignore_errors=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--mem-steps", type=int, default=3)
    parser.add_argument("--ckpt-reps", type=int, default=3)
    parser.add_argument("--transport-mib", type=int, default=32)
    parser.add_argument("--stage2-schedule", default="auto", choices=("auto", "alltoall", "allreduce"),
                        help="stage 2's reduce_schedule in the timing launch (auto: its own trial)")
    parser.add_argument("--skip-memory", action="store_true", help="time only (no memory launches)")
    parser.add_argument("--checkpoint-dir", default=None, help="where the timed checkpoints go")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results", "zero_memory.json"))
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from horovod.testing import run_ranks

    cfg = {"layers": args.layers, "width": args.width, "batch": args.batch, "reps": args.reps,
           "mem_steps": args.mem_steps, "ckpt_reps": args.ckpt_reps, "stage2_schedule": args.stage2_schedule}
    n = args.np
    psi = args.layers * (args.width * args.width + args.width)
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) = {psi / 1e6:.1f} M parameters, "
          f"fp32 AdamW, np={n}")
    load_start = os.getloadavg()
    print(f"load average at the start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}")
    formula = {"distributed": (4 * psi, 4 * psi, 8 * psi),
               "zero1": (4 * psi, 4 * psi, 8 * psi / n),
               "zero2": (4 * psi, 4 * psi / n, 8 * psi / n)}
    mib = 2.0 ** 20
    memory = {}
    print(f"{'variant':<12}{'rank':>5}{'state MiB':>11}{'(formula)':>11}{'grads MiB':>11}{'(formula)':>11}"
          f"{'model-state MiB':>17}{'(formula)':>11}{'peak RSS MiB':>14}{'RSS w/o opt':>13}")
    for v in () if args.skip_memory else VARIANTS:
        memory[v] = run_ranks(_memory, np=n, args=(v, cfg), timeout=1800)
        p, g, s = formula[v]
        for res in memory[v]:
            total = res["param_bytes"] + res["grad_bytes"] + res["state_bytes"]
            print(f"{v:<12}{res['rank']:>5}{res['state_bytes'] / mib:>11.1f}{s / mib:>11.1f}"
                  f"{res['grad_bytes'] / mib:>11.1f}{g / mib:>11.1f}{total / mib:>17.1f}"
                  f"{(p + g + s) / mib:>11.1f}{res['peak_rss'] / mib:>14.1f}"
                  f"{res['rss_before_optimizer'] / mib:>13.1f}")
    timing = run_ranks(_timing, np=n, args=(cfg,), timeout=3600)
    med = {v: statistics.median(max(t[v][i] for t in [r["times"] for r in timing])
                                for i in range(args.reps)) for v in VARIANTS}
    wire = timing[0]["wire_bytes_per_step"]
    trial = ", ".join(f"{k} {t:.3f} s" for k, t in timing[0]["zero2_trial_s"].items())
    print(f"stage 2 used the {timing[0]['zero2_schedule']} schedule"
          + (f" (its trial, slowest rank: {trial})" if trial else " (set by --stage2-schedule)"))
    print(f"\nstep time (median of {args.reps}, slowest rank per step), interleaved:")
    for v in VARIANTS:
        print(f"  {v:<12}{med[v]:8.3f} s   x{med[v] / med['distributed']:.3f} of distributed   "
              f"wire {wire[v] / mib:9.1f} MiB/step/rank   x{wire[v] / wire['distributed']:.3f}")
    schedules = run_ranks(_transports, np=n, args=(args.transport_mib, 2 * args.reps), timeout=600)
    sched = {k: statistics.median(max(r[k][i] for r in schedules) for i in range(2 * args.reps))
             for k in schedules[0]}
    print(f"\nreduce-scatter of {args.transport_mib} MiB (median of {2 * args.reps}, slowest rank): "
          + ", ".join(f"{k} {t * 1e3:.1f} ms" for k, t in sched.items()))
    import tempfile

    with tempfile.TemporaryDirectory(prefix="zero-ckpt-", dir=args.checkpoint_dir) as root:
        ckpt = run_ranks(_checkpoint, np=n, args=(cfg, root), timeout=3600)
    held = {m: statistics.median(max(r[m][i] for r in ckpt) for i in range(args.ckpt_reps))
            for m in ("blocking", "non_blocking", "wait")}
    print(f"\ncheckpoint save (stage 1, median of {args.ckpt_reps}, slowest rank): blocking "
          f"{held['blocking']:.3f} s; non-blocking returns after {held['non_blocking']:.3f} s "
          f"(x{held['non_blocking'] / held['blocking']:.3f}), its wait() after one more step "
          f"{held['wait']:.3f} s")
    out = {"config": cfg, "np": n, "parameters": psi, "formula_bytes": formula, "memory": memory,
           "median_step_s": med, "wire_bytes_per_step": wire, "checkpoint_s": held,
           "reduce_scatter_schedules_s": sched, "zero2_schedule": timing[0]["zero2_schedule"],
           "zero2_trial_s": timing[0]["zero2_trial_s"], "load_average": {"start": load_start, "end": os.getloadavg()},
           "ratios": {v: {"time": med[v] / med["distributed"],
                          "wire": wire[v] / wire["distributed"]} for v in VARIANTS}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"load average at the end: {out['load_average']['end']}")
    print(f"written: {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
