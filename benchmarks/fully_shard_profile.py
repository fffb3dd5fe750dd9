"""Where a fully sharded step's time goes, against ``hvd.DistributedOptimizer``'s, in one launch:
each phase of a step timed on every rank (wall clock of the main thread), the slowest rank's
median over ``--reps`` interleaved steps.

    python benchmarks/fully_shard_profile.py --np 2 --layers 12 --width 1024 --reps 9

Phases of ``hvd.fully_shard`` (its functions wrapped with timers, nested time counted once, in the
innermost phase): ``forward``/``backward``/``optimizer`` (the step's three parts), and inside them
``wait allgather`` (blocked on an allgather), ``copy out of allgather`` (its output into the
unsharded parameters, allocation included), ``start allgather`` (submitting one),
``copy into reduce buffer``, ``start reduce-scatter``, ``wait reduce-scatter``, ``add into .grad``,
``free + release`` (freeing the unsharded tensors, glibc's ``malloc_trim``), ``finite agreement``
and ``hooks (rest)`` (the Python of the hooks outside those). ``DistributedOptimizer``: forward,
backward (its gradient hooks submit the allreduces), ``wait allreduce`` (``synchronize()`` in
``step()``), the optimizer's own update. ``raw`` rows: the raw collectives of each variant's bytes
without compute (``_floor`` of fully_shard_bench.py) and the step with no collective (``local``).

Writes benchmarks/results/fully_shard_profile.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _profile(cfg: dict[str, Any]) -> dict[str, Any]:
    import functools

    import torch

    sys.path.insert(0, cfg["here"])
    import fully_shard_bench as fb

    import horovod.torch as hvd
    from horovod.torch import _shard_collectives as sc
    from horovod.torch import _shard_hooks as sh

    hvd.init()
    torch.set_num_threads(1)
    acc: dict[str, float] = {}
    stack: list[list[float]] = []  # [start, time spent in nested phases]

    def timed(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*a: Any, **k: Any) -> Any:
            stack.append([time.perf_counter(), 0.0])
            try:
                return fn(*a, **k)
            finally:
                t0, nested = stack.pop()
                dt = time.perf_counter() - t0
                acc[name] = acc.get(name, 0.0) + dt - nested
                if stack:
                    stack[-1][1] += dt
        return wrapper

    # the engine's waits, as fully_shard calls them
    mpi_ops = sc.mpi_ops
    real_sync = mpi_ops.synchronize

    class _Ops:  # sc.mpi_ops stand-in: synchronize timed by the phase that waits
        def __getattr__(self, name: str) -> Any:
            return getattr(mpi_ops, name)

    phase = ["other"]

    def sync(h: Any) -> Any:
        return timed(f"wait {phase[0]}", real_sync)(h)

    ops = _Ops()
    ops.synchronize = sync  # type: ignore[attr-defined]
    ops.allgather_async = timed("start allgather", mpi_ops.allgather_async)  # type: ignore[attr-defined]
    ops.grouped_allgather_async = timed("start allgather", mpi_ops.grouped_allgather_async)  # type: ignore[attr-defined]
    ops.reducescatter_async = timed("start reduce-scatter", mpi_ops.reducescatter_async)  # type: ignore[attr-defined]
    ops.allreduce = timed("finite agreement", mpi_ops.allreduce)  # type: ignore[attr-defined]
    sc.mpi_ops = ops  # type: ignore[assignment]

    def labelled(label: str, name: str, fn: Any) -> Any:
        inner = timed(name, fn)

        @functools.wraps(fn)
        def wrapper(*a: Any, **k: Any) -> Any:
            before, phase[0] = phase[0], label
            try:
                return inner(*a, **k)
            finally:
                phase[0] = before
        return wrapper

    patched = {
        "wait_unshard": labelled("allgather", "copy out of allgather", sc.wait_unshard),
        "start_unshard": timed("pack allgather input", sc.start_unshard),
        "reshard": timed("free + release", sc.reshard),
        "reduce": labelled("reduce-scatter", "copy into reduce buffer", sc.reduce),
        "complete": labelled("reduce-scatter", "add into .grad", sc.complete),
        "agree_finite": timed("finite agreement", sc.agree_finite),
    }
    for mod in (sc, sh):
        for k, v in patched.items():
            if hasattr(mod, k):
                setattr(mod, k, v)
    sc.release_freed_memory = timed("release (check)", sc.release_freed_memory)
    real_lookup = sc._malloc_trim

    def counted_trim() -> Any:  # glibc's malloc_trim, counted and timed
        fn = real_lookup()
        if fn is None:
            return None
        inner = timed("malloc_trim", fn)

        def trim(pad: int) -> int:
            acc["malloc_trim calls"] = acc.get("malloc_trim calls", 0.0) + 1
            return inner(pad)
        return trim
    sc._malloc_trim = counted_trim
    sc._TRIM.clear()
    for k in ("_pre_forward", "_post_forward", "_pre_backward", "finish_backward", "_grad_hook"):
        if k == "_grad_hook":
            real = sh._grad_hook
            sh._grad_hook = lambda g, i, real=real: timed("hooks (rest)", real(g, i))  # type: ignore[assignment]
        else:
            setattr(sh, k, timed("hooks (rest)", getattr(sh, k)))

    mesh = fb._gloo()
    x = torch.randn(cfg["batch"], cfg["width"])
    variants = list(cfg["variants"])
    built = {v: fb._build(v, cfg, mesh) for v in variants if not v.startswith("floor_")}
    floors = {v: fb._floor(v, cfg) for v in variants if v.startswith("floor_")}
    rows: dict[str, list[dict[str, float]]] = {v: [] for v in variants}

    for rep in range(cfg["reps"] + 1):
        k = rep % len(variants)
        for v in variants[k:] + variants[:k]:
            hvd.barrier()
            acc.clear()
            t0 = time.perf_counter()
            if v in floors:
                floors[v]()
                t = {"step": time.perf_counter() - t0}
            else:
                model, opt = built[v]
                opt.zero_grad()
                t1 = time.perf_counter()
                acc.clear()
                loss = model(x).square().mean()
                t2 = time.perf_counter()
                fwd = dict(acc)
                acc.clear()
                loss.backward()
                t3 = time.perf_counter()
                bwd = dict(acc)
                acc.clear()
                if v == "distributed":
                    ts = time.perf_counter()
                    opt.synchronize()
                    acc["wait allreduce"] = time.perf_counter() - ts
                    with opt.skip_synchronize():
                        opt.step()
                else:
                    opt.step()
                t4 = time.perf_counter()
                t = {"step": t4 - t0, "zero_grad": t1 - t0, "forward": t2 - t1, "backward": t3 - t2,
                     "optimizer": t4 - t3}
                for tag, part, total in (("fwd", fwd, t2 - t1), ("bwd", bwd, t3 - t2), ("opt", acc, t4 - t3)):
                    for name, dt in part.items():
                        t[f"{tag}: {name}"] = dt
                    calls = part.pop("malloc_trim calls", 0.0)
                    t[f"{tag}: compute (rest)"] = total - sum(part.values())
                    if calls:
                        t[f"{tag}: malloc_trim calls"] = calls
            if rep:
                rows[v].append(t)
    return {"rank": hvd.rank(), "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--variants", default="distributed,fully_shard,fully_shard_norelease,local,"
                        "floor_allreduce,floor_fully_shard")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results", "fully_shard_profile.json"))
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from horovod.testing import run_ranks

    cfg = {"here": os.path.dirname(os.path.abspath(__file__)),
           "layers": args.layers, "width": args.width, "batch": args.batch, "reps": args.reps,
           "variants": args.variants.split(",")}
    load = os.getloadavg()
    res = run_ranks(_profile, np=args.np, args=(cfg,), timeout=1800)
    out: dict[str, Any] = {"config": cfg, "np": args.np, "load_start": load, "phases": {}}
    print(f"{args.layers} x Linear({args.width}, {args.width}), np={args.np}, median of {args.reps} "
          f"(slowest rank per step per phase); load average {load[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    for v in cfg["variants"]:
        keys: list[str] = []
        for r in res:
            for row in r["rows"][v]:
                keys += [k for k in row if k not in keys]
        med = {k: statistics.median(max(r["rows"][v][i].get(k, 0.0) for r in res) for i in range(args.reps))
               for k in keys}
        per = [{k: statistics.median(row.get(k, 0.0) for row in r["rows"][v]) for k in keys} for r in res]
        out["phases"][v] = med
        out.setdefault("per_rank", {})[v] = per
        print(f"\n{v}: step {med['step']:.4f} s   (per rank: "
              + ", ".join(f"{p['step']:.4f}" for p in per) + ")")
        for k in keys:
            if k != "step":
                print(f"  {k:<28}{med[k]:8.4f} s   (" + ", ".join(f"{p[k]:.4f}" for p in per) + ")")
    out["load_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
