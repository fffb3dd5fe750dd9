"""Where a fully sharded step's page faults come from: per phase of a step (``zero_grad``,
forward, backward, optimizer) the minor page faults of rank 0 (``minflt`` of /proc/self/stat: a
fault is a page that was handed back to the kernel, or never touched, and is touched now), the
releases (glibc ``malloc_trim`` calls) of ``hvd.fully_shard`` and the phase's time; with the
memory release on and off, alternated, one launch of ``--np`` ranks each.

    python benchmarks/fully_shard_faults.py --np 2 --layers 12 --width 1024 --steps 8
    python benchmarks/fully_shard_faults.py --direct      # gradients as the reduce-scatter's input
    python benchmarks/fully_shard_faults.py --addresses   # and each module's gradient address

It first prints what one 4 MiB gradient's copy into the packed reduce-scatter layout costs
against faulting in 4 MiB of fresh pages (one process, median of 30).

``--direct`` makes every module's reduce-scatter take its gradients as they are (the path used
off CPU) instead of copying them into the root's kept buffer (CPU's path); ``--addresses`` prints,
for the last step, the address of each module's weight gradient as the reduce-scatter gets it.
glibc only. Figures: docs/fully_shard.md, "Sixth round".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

PHASES = ("zero_grad", "forward", "backward", "optimizer")


def _minflt() -> int:
    with open("/proc/self/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[7])


def _run(release: bool, layers: int, width: int, steps: int, direct: bool, addresses: bool) -> dict[str, Any]:
    import torch

    import horovod.torch as hvd
    from horovod.torch import _shard_collectives as C

    hvd.init()
    torch.set_num_threads(1)
    blocks = []
    for i in range(layers):
        torch.manual_seed(i)
        b = torch.nn.Linear(width, width)
        hvd.fully_shard(b)
        blocks.append(b)
    model = torch.nn.Sequential(*blocks)
    hvd.fully_shard(model)
    groups = [m._groups()[0] for m in model.modules() if isinstance(m, hvd.FullyShardedModule)]
    for g in groups:
        g.release_memory = release
        if direct:
            g.direct = [q for q in g.params if q.seg and q.unsharded.requires_grad]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(16, width)
    trims = [0]
    if not C._TRIM:
        C._TRIM.append(C._malloc_trim())
    found = C._TRIM[0]
    if found is not None:
        # (malloc_trim, in use); an older checkout keeps malloc_trim alone
        trim = found[0] if isinstance(found, tuple) else found

        def counted(pad: int) -> Any:
            trims[0] += 1
            return trim(pad)
        C._TRIM[0] = (counted, found[1]) if isinstance(found, tuple) else counted
    seen: list[tuple[int, int]] = []
    if addresses:
        reduce = C.reduce

        def logged(g: Any) -> None:
            big = [q.unsharded.grad for q in g.params if q.unsharded.grad is not None and q.unsharded.grad.ndim == 2]
            if big:
                seen.append((g.index, big[0].data_ptr()))
            reduce(g)
        C.reduce = logged
        import horovod.torch._shard_hooks as H
        H.reduce = logged
    rows = []
    for _ in range(steps):
        hvd.barrier()
        seen.clear()
        n0, f, t = trims[0], [_minflt()], [time.perf_counter()]
        opt.zero_grad()
        f.append(_minflt()), t.append(time.perf_counter())
        loss = model(x).square().mean()
        f.append(_minflt()), t.append(time.perf_counter())
        loss.backward()
        f.append(_minflt()), t.append(time.perf_counter())
        opt.step()
        f.append(_minflt()), t.append(time.perf_counter())
        row = {p: f[i + 1] - f[i] for i, p in enumerate(PHASES)}
        row.update({p + "_s": t[i + 1] - t[i] for i, p in enumerate(PHASES)})
        row["releases"] = trims[0] - n0
        row["step_s"] = t[-1] - t[0]
        rows.append(row)
    return {"rank": hvd.rank(), "rows": rows, "addresses": list(seen)}


def _copy_against_faults() -> str:
    import mmap

    import torch

    torch.set_num_threads(1)
    src = torch.randn(1024, 1024)  # 4 MiB of float32: one module's weight gradient at width 1024
    buf = torch.empty(2, 512 * 1024 + 512)  # the packed layout at np=2: each rank's rows padded
    copy, fault = [], []
    for _ in range(30):
        t = time.perf_counter()
        buf[:, :512 * 1024].copy_(src.view(2, -1))
        copy.append(time.perf_counter() - t)
        m = mmap.mmap(-1, 4 << 20)
        view = memoryview(m)
        t = time.perf_counter()
        for off in range(0, 4 << 20, mmap.PAGESIZE):
            view[off] = 1
        fault.append(time.perf_counter() - t)
        view.release()
        m.close()
    return (f"copying a 4 MiB gradient into the packed buffer {1e3 * statistics.median(copy):.2f} ms; "
            f"faulting in 4 MiB of fresh pages {1e3 * statistics.median(fault):.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8, help="steps per launch (the first two are not reported)")
    parser.add_argument("--launches", type=int, default=2, help="launches per mode, alternated")
    parser.add_argument("--direct", action="store_true")
    parser.add_argument("--addresses", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from horovod.testing import run_ranks

    print(f"{args.layers} x Linear({args.width}, {args.width}), np={args.np}, "
          f"gradients {'as the reduce-scatter input (direct)' if args.direct else 'as the code chooses'}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(_copy_against_faults())
    for k in range(2 * args.launches):
        release = k % 2 == 0
        out = run_ranks(_run, np=args.np, args=(release, args.layers, args.width, args.steps, args.direct,
                                                 args.addresses), timeout=900)
        rows = out[0]["rows"][2:]
        print(f"release {'on ' if release else 'off'} (load {os.getloadavg()[0]:.1f}), rank 0, median of "
              f"{len(rows)} steps:")
        for key in PHASES + ("releases",):
            print(f"  {key:<10} {statistics.median(r[key] for r in rows):8.0f} faults" if key != "releases" else
                  f"  {key:<10} {statistics.median(r[key] for r in rows):8.1f} per step (median; "
                  f"each step: {[r[key] for r in rows]})", end="")
            if key in PHASES:
                print(f"   {statistics.median(r[key + '_s'] for r in rows):.3f} s")
            else:
                print()
        print(f"  step       {statistics.median(r['step_s'] for r in rows):.3f} s")
        if args.addresses:
            base = min(a for _, a in out[0]["addresses"])
            print("  weight gradients, last step (module: offset from the lowest, MiB): " +
                  ", ".join(f"{i}: {(a - base) / 2**20:.2f}" for i, a in out[0]["addresses"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
