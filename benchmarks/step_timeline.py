"""Where one cached grouped step of 161 tiny tensors goes, phase by phase, on both ranks.

    horovodrun --gloo -np 2 python benchmarks/step_timeline.py --reps 300
    mpirun -np 2 --oversubscribe --bind-to none python benchmarks/step_timeline.py --reps 300

Each rep: a barrier (a Gloo process group of its own under ``horovodrun --gloo``, MPI's otherwise),
then one ``hvd.grouped_allreduce_async`` of the 161 tensors and its ``synchronize``. Timers around
the engine's methods record, on every rank, when each phase begins and ends (``time.perf_counter``:
CLOCK_MONOTONIC, one clock for every process of this host, so the ranks' events compare): the
submission, the round's agreement up to the exchange (the bits, and on Gloo the carried row's
packing), the exchange (Gloo: posting the sends and the next exchange's receives, waiting for
this one's; MPI: the bit AND), the rows read after it, the plan, the batch's run and the
completion. Rank 0 prints, per rank, the median over the reps where each rank ran one
round (JSON), and the skew between the ranks: when each left the barrier and entered the exchange,
and how long after the peer's send each rank's receive completed.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import horovod.torch as hvd
from horovod.common.context import get_context
from horovod.common.objects import allgather_object

PHASES = [("submit", "start", "submit>"), ("bits and row", "agree<", "xchg<"), ("exchange", "xchg<", "xchg>"),
          ("post the sends (+ the next receives)", "xchg<", "rwait<"), ("wait for receives", "rwait<", "rwait>"),
          ("read rows", "xchg>", "agree>"), ("plan", "execute<", "run<"), ("run", "run<", "run>"),
          ("complete", "complete<", "complete>"), ("step", "start", "end")]


def instrument(eng: Any, mark: Callable[[str], None]) -> None:
    """Timers around the running engine's methods: ``mark(label + "<")`` as each begins and
    ``mark(label + ">")`` as it ends (drive, agree, xchg, execute, run, complete); on Gloo with a
    carried negotiation also the sends (``send``), their waits (``swait``), the receives' posting
    (``post``) and their waits (``rwait``). ``tiny_step_planes.py`` uses it too."""
    backend = eng.backend

    def wrap(obj: Any, attr: str, label: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a: Any, **k: Any) -> Any:
            mark(label + "<")
            try:
                return fn(*a, **k)
            finally:
                mark(label + ">")
        setattr(obj, attr, timed)

    wrap(eng, "_drive_once", "drive")
    wrap(eng.rounds, "agree", "agree")
    carrier = eng.rounds.carrier
    wrap(carrier, "_exchange", "xchg") if carrier is not None else wrap(backend, "and_bits", "xchg")
    wrap(eng.runner, "execute", "execute")
    wrap(eng.runner.executor, "run", "run")
    wrap(eng.runner, "complete", "complete")
    if carrier is None:
        return
    world = backend._world  # the receives' and sends' waits inside exchange_rows

    class _Waits:
        def __init__(self, w: Any, label: str) -> None:
            self.w, self.label = w, label

        def wait(self) -> Any:
            mark(self.label + "<")
            try:
                return self.w.wait()
            finally:
                mark(self.label + ">")

        def __getattr__(self, a: str) -> Any:
            return getattr(self.w, a)

    class _PG:
        def __getattr__(self, a: str) -> Any:
            return getattr(world, a)

        def send(self, *a: Any) -> Any:
            mark("send<")
            w = world.send(*a)
            mark("send>")
            return _Waits(w, "swait")

        def recv(self, *a: Any) -> Any:
            mark("post<")
            w = _Waits(world.recv(*a), "rwait")
            mark("post>")
            return w

    backend._world = _PG()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--tensors", type=int, default=161)
    args = p.parse_args()
    hvd.init()
    eng = get_context().engine
    backend = eng.backend
    ev: list[tuple[str, float]] = []
    clock = time.perf_counter

    def mark(name: str) -> None:
        ev.append((name, clock()))

    instrument(eng, mark)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() != hvd.size():
        pg = backend._make_pg("bench.step_timeline", hvd.rank(), hvd.size())
        one = torch.zeros(1, dtype=torch.int64)

        def barrier() -> None:
            pg.allreduce([one]).wait()
    else:
        barrier = comm.Barrier
    tensors = [torch.ones(4) for _ in range(args.tensors)]

    def step() -> None:
        mark("start")
        h = hvd.grouped_allreduce_async_(tensors, name="timeline.grouped", op=hvd.Average)
        mark("submit>")
        hvd.synchronize(h)
        mark("end")

    for _ in range(30):
        barrier()
        step()
    steps = []
    for _ in range(args.reps):
        ev.clear()
        mark("bar<")
        barrier()
        step()
        steps.append(list(ev))
    every = allgather_object(steps, name="step_timeline.events")
    rank = hvd.rank()
    hvd.shutdown()
    if rank == 0:
        print(json.dumps(summary(every)), flush=True)


def summary(every: list[list[list[tuple[str, float]]]]) -> dict[str, Any]:
    """Medians per rank over the reps in which every rank drove one round."""
    out: dict[str, Any] = collections.defaultdict(dict)
    rows: dict[str, list[float]] = collections.defaultdict(list)
    single = 0
    for reps in zip(*every):
        if any(sum(1 for n, _ in r if n == "drive<") != 1 for r in reps):
            continue
        single += 1
        first = [{n: t for n, t in reversed(r)} for r in reps]
        for me, at in enumerate(first):
            for label, a, b in PHASES:
                if a in at and b in at:
                    rows[f"rank {me}: {label}"].append((at[b] - at[a]) * 1e3)
            for other, peer in enumerate(first):
                if other != me:
                    rows[f"rank {me}: left the barrier after rank {other}"].append((at["start"] - peer["start"]) * 1e3)
                    if "rwait>" in at and "send>" in peer:
                        rows[f"rank {me}: receive done after rank {other}'s send"].append(
                            (at["rwait>"] - peer["send>"]) * 1e3)
        rows["last end - last start"].append((max(a["end"] for a in first) - max(a["start"] for a in first)) * 1e3)
    out = {k: round(statistics.median(v), 3) for k, v in rows.items()}
    return {"reps_one_round": single, "reps": len(every[0]), "median_ms": out}


if __name__ == "__main__":
    main()
