"""Peak memory per rank over one training step, measured (not counted): unsharded
``DistributedOptimizer`` against ``ZeroRedundancyOptimizer`` stages 1 and 2, fp32 AdamW, on CPU.

    python benchmarks/zero_peak_memory.py --np 4 --layers 6 --width 2048     # 25 M parameters
    python benchmarks/zero_peak_memory.py --np 4 --layers 24 --width 2048    # 100 M parameters

Each case runs in its own launch of ``--np`` ranks (a process's resident memory belongs to one
case). Per rank: ``base`` is the resident set after ``hvd.init()``, before the model exists; the
model is built, the optimizer wraps it and ``--warmup`` steps allocate its state; then, before
each of ``--steps`` measured steps, the kernel's peak-RSS counter is reset (``echo 5 >
/proc/self/clear_refs`` resets ``VmHWM``) and after it ``VmHWM`` is read: the peak of the step.
Reported per rank: ``peak - base`` (what training holds at its peak: parameters, gradients,
optimizer state, activations, the reduction's buffers, the allocator's cache), the resident set
just before the step, and the optimizer-state bytes counted. tracemalloc sees none of torch's
allocations, hence RSS.

A case is a function ``(model) -> (model, optimizer)`` in ``CASES``; a fully sharded case
(``hvd.fully_shard`` and a plain optimizer over the shards) is one more entry, run when
``horovod.torch`` has it.

Writes benchmarks/results/zero_peak_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def _distributed(model: Any) -> tuple[Any, Any]:
    import torch

    import horovod.torch as hvd

    return model, hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4),
                                           named_parameters=model.named_parameters())


def _zero(stage: int) -> Any:
    def build(model: Any) -> tuple[Any, Any]:
        import torch

        import horovod.torch as hvd

        return model, hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                                                  lr=1e-4, named_parameters=model.named_parameters())
    return build


def _fully_sharded(model: Any) -> tuple[Any, Any]:
    import torch

    import horovod.torch as hvd

    for block in model:
        hvd.fully_shard(block)  # type: ignore[attr-defined]
    hvd.fully_shard(model)  # type: ignore[attr-defined]
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


CASES = {"distributed": _distributed, "zero1": _zero(1), "zero2": _zero(2),
         "fully_shard": _fully_sharded}


def _status(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _measure(case: str, cfg: dict[str, int]) -> dict[str, Any]:
    import torch

    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    base = _status("VmRSS")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(cfg["width"], cfg["width"])
                                  for _ in range(cfg["layers"])])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    model, opt = CASES[case](model)
    x = torch.randn(cfg["batch"], cfg["width"])
    peaks, before = [], []
    for k in range(cfg["warmup"] + cfg["steps"]):
        if k >= cfg["warmup"]:
            before.append(_status("VmRSS") - base)
            _reset_peak()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if k >= cfg["warmup"]:
            peaks.append(_status("VmHWM") - base)
    state = opt.optim.state if isinstance(opt, hvd.ZeroRedundancyOptimizer) else opt.state
    return {"rank": hvd.rank(), "peak": max(peaks), "before_step": max(before),
            "state_bytes": sum(v.numel() * v.element_size() for s in state.values() for v in s.values()
                               if isinstance(v, torch.Tensor)),
            "params": sum(p.numel() for p in model.parameters())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--layers", type=int, default=6, help="Linear(width, width) layers")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cases", default=None, help="comma-separated, default: every case available")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results", "zero_peak_memory.json"))
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import horovod.torch as hvd
    from horovod.testing import run_ranks

    cases = args.cases.split(",") if args.cases else [
        c for c in CASES if c != "fully_shard" or hasattr(hvd, "fully_shard")]
    cfg = {k: getattr(args, k) for k in ("layers", "width", "batch", "warmup", "steps")}
    results: dict[str, Any] = {}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    for case in cases:
        rows = run_ranks(_measure, np=args.np, timeout=args.timeout, args=(case, cfg))
        results[case] = rows
        with open(args.out, "w") as fh:  # after every case: a long run keeps what it measured
            json.dump({"config": {**cfg, "np": args.np, "params": rows[0]["params"]},
                       "results": results}, fh, indent=1)
        mib = 1024 * 1024
        print(f"{case:12s} peak - base per rank (MiB): "
              + ", ".join(f"{r['peak'] / mib:.0f}" for r in rows)
              + f"; before the step: {max(r['before_step'] for r in rows) / mib:.0f}"
              + f"; optimizer state: {max(r['state_bytes'] for r in rows) / mib:.0f}", flush=True)
    ref = max(r["peak"] for r in results.get("distributed", [{"peak": 0}]))
    if ref:
        for case, rows in results.items():
            print(f"{case:12s} worst rank's peak / DistributedOptimizer's: {max(r['peak'] for r in rows) / ref:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
