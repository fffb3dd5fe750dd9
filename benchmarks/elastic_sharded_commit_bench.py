"""``hvd.elastic.TorchState.commit()`` of a fully sharded model with AdamW: the sharded commit
(default, ``replicas="buddy"``: each rank keeps its part and one replica) against the whole-copy
commit (``replicas="all"``), interleaved in one launch: the bytes each rank keeps of a commit and
the time of one ``commit()`` (median of ``--reps``, slowest rank).

    python benchmarks/elastic_sharded_commit_bench.py --np 3 --layers 12 --width 1024 --reps 5
"""

from __future__ import annotations

import argparse
import json
import statistics


def _bench(layers: int, width: int, reps: int) -> dict:
    import time

    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for block in model:
        hvd.fully_shard(block)
    hvd.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, width)
    opt.zero_grad()
    F.mse_loss(model(x), x).backward()
    opt.step()
    states = {"buddy": hvd.elastic.TorchState(model, opt),
              "all": hvd.elastic.TorchState(model, opt, replicas="all")}
    for s in states.values():
        s.sync()
    times: dict[str, list[float]] = {k: [] for k in states}
    for _ in range(reps):
        for k, s in states.items():  # interleaved
            hvd.allreduce(torch.zeros(1), name=f"bench.barrier.{k}")
            t = time.perf_counter()
            s.save()  # what commit() does besides the host check
            times[k].append(time.perf_counter() - t)
    held = {k: sum(h.committed_bytes() for h in s._handlers.values()) for k, s in states.items()}
    return {"rank": hvd.rank(), "times": times, "held": held}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, default=3)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from horovod.testing import run_ranks

    outs = run_ranks(_bench, np=args.np, timeout=1200, args=(args.layers, args.width, args.reps))
    params = args.layers * (args.width * args.width + args.width)
    print(f"{args.layers} x Linear({args.width}, {args.width}) = {params / 1e6:.1f} M parameters, AdamW, "
          f"np={args.np}; whole committed state = {params * 12 / 2**20:.0f} MiB (fp32 parameters + 2 AdamW states)")
    result = {"np": args.np, "parameters": params, "whole_bytes": params * 12, "variants": {}}
    for k in ("buddy", "all"):
        per_rep = [max(o["times"][k][i] for o in outs) for i in range(args.reps)]
        held = max(o["held"][k] for o in outs)
        result["variants"][k] = {"commit_s_median": statistics.median(per_rep), "commit_s": per_rep,
                                 "held_bytes_max_rank": held}
        print(f"replicas={k!r:8} commit {statistics.median(per_rep):.3f} s (median of {args.reps}, slowest rank); "
              f"held per rank {held / 2**20:.1f} MiB = {held / (params * 12):.3f} of the whole")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
