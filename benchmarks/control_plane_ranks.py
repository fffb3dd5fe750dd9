"""The control plane on real processes: the first (uncached) and the cached step of a 161-tensor
set through ``horovod.numpy``, at several rank counts, for two code trees, interleaved in one run.

    git worktree add /tmp/hvd-before <commit before the change>
    python benchmarks/control_plane_ranks.py --np 16 32 --before /tmp/hvd-before

Each (tree, np) pair is one ``mpirun --oversubscribe`` of this file in worker mode; the pairs run
in turn, ``--reps`` times, so machine noise hits both trees alike. Tensors hold 4 floats, so the
transport costs almost nothing and the steps measure negotiation. Rank 0 of each launch reports the
first step (every name negotiated through the coordinator): its wall time, the CPU time rank 0
spent in the coordinator, and in whole negotiations (gather, coordinator, broadcast, encoding); the
median of the cached steps. With more ranks than cores the wall times mostly measure the
scheduler (a rank waits for peers that are not running); the coordinator's share does not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--np", type=int, nargs="+", default=[16, 32])
parser.add_argument("--before", default="", help="a checkout of the code to compare against")
parser.add_argument("--tensors", type=int, default=161)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--reps", type=int, default=2)
parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def _timed(cls: type, attr: str, acc: dict[str, float]) -> None:
    """Add the CPU time the calling thread spends in ``cls.attr`` to ``acc[attr]`` (rank 0's
    share of a step; CPU time, not wall time, so that a rank preempted by the 15-31 others on
    the same cores is not charged for the wait)."""
    fn = getattr(cls, attr)

    def timed(*a: object, **k: object) -> object:
        t0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            acc[attr] = acc.get(attr, 0.0) + time.thread_time() - t0

    setattr(cls, attr, timed)


def worker(args: argparse.Namespace) -> None:
    import numpy as np

    import horovod.numpy as hvd
    from horovod.common.engine import loop, negotiation

    acc: dict[str, float] = {}
    for attr in ("submit_encoded", "submit", "ready"):  # the coordinator, in either tree
        if attr in vars(negotiation.Coordinator):
            _timed(negotiation.Coordinator, attr, acc)
    # gather + coordinator + broadcast, encode/decode: the round controller's (the engine's in
    # trees from before the engine was split by role)
    try:
        from horovod.common.engine.rounds import RoundController as negotiates
    except ImportError:
        negotiates = loop.Engine
    _timed(negotiates, "_negotiate", acc)
    hvd.init()
    grads = [np.full(4, float(hvd.rank()), np.float32) for _ in range(args.tensors)]
    names = [f"grad.module.layer{i // 12}.block{i % 12}.conv.weight" for i in range(args.tensors)]
    times = []
    first: dict[str, float] = {}
    for step in range(args.steps):
        hvd.barrier()
        if step == 1:
            first = dict(acc)
        acc.clear()
        t0 = time.perf_counter()
        handles = [hvd.allreduce_async_(g, name=n, op=hvd.Sum) for g, n in zip(grads, names)]
        for h in handles:
            hvd.synchronize(h)
        times.append(time.perf_counter() - t0)
    if hvd.rank() == 0:
        coord = sum(v for k, v in first.items() if k != "_negotiate")
        print("RESULT " + json.dumps({"first_ms": times[0] * 1e3,
                                      "first_coordinator_cpu_ms": coord * 1e3,
                                      "first_negotiate_cpu_ms": first.get("_negotiate", 0.0) * 1e3,
                                      "cached_ms": statistics.median(times[1:]) * 1e3}), flush=True)
    hvd.shutdown()


def launch(tree: str, np_: int, args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["mpirun", "--oversubscribe", "-np", str(np_), "-x", "PYTHONPATH", sys.executable,
           os.path.abspath(__file__), "--worker", "--tensors", str(args.tensors), "--steps", str(args.steps)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"np={np_} tree={tree} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def main() -> None:
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    after = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"after": after, **({"before": os.path.abspath(args.before)} if args.before else {})}
    got: dict[tuple[str, int], list[dict[str, float]]] = {}
    for _ in range(args.reps):
        for np_ in args.np:
            for label, tree in trees.items():
                got.setdefault((label, np_), []).append(launch(tree, np_, args))
    for np_ in args.np:
        row = {}
        for label in trees:
            runs = got[(label, np_)]
            row[f"{label}_first_ms"] = round(statistics.median(r["first_ms"] for r in runs), 2)
            for key in ("first_coordinator_cpu_ms", "first_negotiate_cpu_ms", "cached_ms"):
                row[f"{label}_{key}"] = round(statistics.median(r[key] for r in runs), 2)
        print(json.dumps({"np": np_, "tensors": args.tensors, **row}), flush=True)


if __name__ == "__main__":
    main()
