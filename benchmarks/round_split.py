"""Does work that holds the GIL just before a step split the step's negotiation round?

    mpirun -np 2 --bind-to none python benchmarks/round_split.py [--tensors 161] [--reps 200]

Each repetition: a barrier, then ``--pre`` (``none``, a 2 ms ``busy`` loop holding the GIL, or a
2 ms ``nap``), a second barrier, then the step: ``hvd.allreduce_async_`` of every tensor and
``hvd.synchronize`` of every handle. The pre-step kinds alternate, twice each. Rank 0 prints, per
kind, the median submission and synchronize times and the engine's rounds per step, by the
thread that ran them (``main``: the caller driving rounds from ``synchronize``; ``engine``: the
engine thread). One round per step from ``main`` is the fast case. A round from the engine thread
that holds only part of the step pairs with a peer's round holding all of it; the rest then waits
for the next round, which is where a slow synchronize comes from.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import threading
import time
from typing import Any

import torch

import horovod.torch as hvd


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=161, help="tensors of 4 floats in a step")
    p.add_argument("--reps", type=int, default=200, help="steps per pre-step kind and pass")
    p.add_argument("--pre-ms", type=float, default=2.0, help="length of the busy loop or the sleep")
    return p.parse_args()


def main() -> None:
    args = _args()
    hvd.init()
    from mpi4py import MPI

    from horovod.common.context import get_context

    comm = MPI.COMM_WORLD
    engine = get_context().engine
    rounds: collections.Counter[str] = collections.Counter()
    inner = engine._round
    main_thread = threading.get_ident()

    def counted(new: Any, shutdown: bool) -> Any:
        rounds["main" if threading.get_ident() == main_thread else "engine"] += 1
        return inner(new, shutdown)

    engine._round = counted  # type: ignore[method-assign]
    tensors = [torch.ones(4) for _ in range(args.tensors)]
    names = [f"grad.{i}" for i in range(args.tensors)]
    pre_s = args.pre_ms / 1e3

    def pre(kind: str) -> None:
        if kind == "busy":
            end = time.perf_counter() + pre_s
            while time.perf_counter() < end:
                pass
        elif kind == "nap":
            time.sleep(pre_s)

    for kind in ("none", "busy", "nap") * 2:
        submit, sync = [], []
        rounds.clear()
        for _ in range(args.reps):
            comm.Barrier()
            pre(kind)
            comm.Barrier()
            t0 = time.perf_counter()
            handles = [hvd.allreduce_async_(t, name=n, op=hvd.Average) for t, n in zip(tensors, names)]
            t1 = time.perf_counter()
            for h in handles:
                hvd.synchronize(h)
            submit.append(t1 - t0)
            sync.append(time.perf_counter() - t1)
        if hvd.rank() == 0:
            per_step = {k: round(rounds[k] / args.reps, 2) for k in ("main", "engine")}
            print(f"{kind:5s} submit {statistics.median(submit) * 1e3:.3f} ms  synchronize "
                  f"{statistics.median(sync) * 1e3:.3f} ms  rounds per step {per_step}", flush=True)
    engine.__dict__.pop("_round", None)
    hvd.shutdown()


if __name__ == "__main__":
    main()
