"""Per-step times of ResNet-50's gradient set on the MPI plane, every step printed (not medians only).

    horovodrun -np 2 python benchmarks/mpi_plane_steps.py [--reps 10] [--dtype float32]
    horovodrun -np 2 python benchmarks/mpi_plane_steps.py --phases --modes hvd   # where a step goes

Modes (each repetition runs every mode once, in turn, after a barrier; default flat,hvd,grp):
  flat    one mpi4py ``Allreduce`` of one flat float32 buffer of the same size, then / size (the
          reference of docs/performance.md's "The MPI data plane")
  pieces  mpi4py: the same flat buffer in 2 MiB pieces, each reduced in place and divided while
          hot (the best raw schedule of ``gradsync_limit.py`` on this machine)
  pieces16  the same in 16 MiB pieces (the best raw schedule in the machine's other state; the
          engine follows the faster of the two: ``engine/pieces.py``)
  sched   mpi4py: the engine's piece schedule written directly on the torch tensors' own memory
          (``raw_schedules.schedule``, pieces in place where the engine would reduce them in
          place): the fastest raw schedule of the same bytes in the same memory
  sched-own  the same with every whole piece reduced where it lies (no huge-page test)
  pert    mpi4py: one in-place ``Allreduce`` per tensor, whole (161 calls)
  hvd     ``horovod.torch.allreduce_async_`` of each of the 161 tensors, then ``synchronize`` each
  grp     ``horovod.torch.grouped_allreduce_`` of the 161 tensors
  opt     what ``DistributedOptimizer`` reduces (flat gradients): the 161 tensors as views of one
          flat buffer on 2 MiB-aligned huge pages (``_flat_grads.flat_buckets``), one grouped
          in-place allreduce per 25 MiB bucket
  opt-zeros  the same views of one ``torch.zeros`` buffer (the optimizer's allocation before)
  opt-2m / opt-16m  ``opt`` with the piece size held at 2 / 16 MiB (the engine's piece-size
          follower, which ``opt`` runs with on MPI, counting nothing meanwhile)
  hvd-late  hvd with only the last submission waking the engine thread (the private ``_wake``
          flag): what waking it at the first costs
  hvd-copy / hvd-own  hvd with the executor's timed choice for memory not on huge pages forced:
          copied through the fusion buffer / reduced where it lies
  core    ``horovod.numpy.allreduce_async_`` of NumPy views of the same torch tensors, then
          ``synchronize`` (the engine's core path on the same memory, without the torch binding)
  np      ``horovod.numpy.allreduce_async_`` of NumPy arrays of the same shapes (NumPy's memory)
  np-oop  ``horovod.numpy.allreduce_async`` (out of place: results in the engine's warm pool)

Rank 0 prints one JSON line (medians, the load average, huge pages) and, per mode, every step's
milliseconds, the milliseconds inside the backend's MPI calls on each rank (``mpi0``/``mpi1``) and
rank 0's minor page faults per step. ``--phases`` times the parts of every step (engine modes:
packing into and out of the fusion buffer, scaling, MPI, negotiation, and ``rest`` = the step less
those: submission, hand-offs to the engine thread, waiting; raw modes: pack, mpi, unpack) and
prints, per mode, each part's per-step milliseconds (calls reduced in place against through the
buffer for the engine modes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import raw_schedules  # noqa: E402
from shapes import MODELS  # noqa: E402

import horovod.numpy as hvd_np  # noqa: E402
import horovod.torch as hvd  # noqa: E402
from horovod.common.backends import mpi as mpi_backend  # noqa: E402
from horovod.common.context import get_context  # noqa: E402
from horovod.common.engine import executor, host_buffers, placement  # noqa: E402
from horovod.common.engine.pages import huge_page_backed, huge_page_empty  # noqa: E402
from horovod.torch._convert import huge_page_zeros  # noqa: E402
from horovod.torch._flat_grads import flat_buckets  # noqa: E402

CHUNK = 2 * 1024 * 1024  # the engine's piece size (HOROVOD_CHUNK_BYTES default)

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default="resnet50", choices=sorted(MODELS))
parser.add_argument("--reps", type=int, default=10)
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--modes", default="flat,hvd,grp")
parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
parser.add_argument("--phases", action="store_true")

_acc: dict[str, list[float]] = {}
_spans: list[tuple[float, float]] = []  # (start, end) of each batch the executor ran this step


def _timed(cls: Any, name: str, key: str, static: bool = False) -> None:
    orig = cls.__dict__[name]
    fn = orig.__func__ if static else orig

    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            d = _acc.setdefault(key, [0.0, 0])
            d[0] += time.perf_counter() - t0
            d[1] += 1
    setattr(cls, name, staticmethod(wrapper) if static else wrapper)


def _instrument(phases: bool) -> dict[str, int]:
    _timed(mpi_backend.MPIBackend, "allreduce", "mpi")
    where = {"in_place": 0, "buffered": 0}
    if not phases:
        return where
    for name in ("and_bits", "gather_to_root", "bcast_from_root"):
        _timed(mpi_backend.MPIBackend, name, "negotiation")
    run = executor.Executor.run

    def timed_run(self: Any, batch: Any, entries: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return run(self, batch, entries)
        finally:
            t1 = time.perf_counter()
            _spans.append((t0, t1))
    executor.Executor.run = timed_run  # type: ignore[method-assign]
    _timed(host_buffers.NumpyBuffers, "pack", "pack")
    _timed(host_buffers.NumpyBuffers, "unpack", "unpack")
    _timed(host_buffers.NumpyBuffers, "scale", "scale", static=True)
    region = placement.HostPlacement.region

    def counted(self: Any, call: Any, items: Any, segs: Any, ops: Any) -> Any:
        r = region(self, call, items, segs, ops)
        where["in_place" if r is not None else "buffered"] += 1
        return r
    placement.HostPlacement.region = counted  # type: ignore[method-assign]
    return where


def main() -> None:
    args = parser.parse_args()
    where = _instrument(args.phases)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(1)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    shapes = MODELS[args.model]()
    numel = sum(math.prod(s) for s in shapes)
    flat = np.ones(numel, np.float32)
    tensors = [torch.ones(s, dtype=getattr(torch, args.dtype)) for s in shapes]
    names = [f"grad.{i}" for i in range(len(tensors))]
    raw: dict[str, dict[str, float]] = {}  # raw mode -> its phases of the current step

    def mode_hvd() -> None:
        handles = [hvd.allreduce_async_(t, name=n, op=hvd.Average) for t, n in zip(tensors, names)]
        for h in handles:
            hvd.synchronize(h)

    def mode_hvd_late_wake() -> None:  # the engine thread woken by the last submission only
        last = len(tensors) - 1
        handles = [hvd.allreduce_async_(t, name=n, op=hvd.Average, _wake=i == last)
                   for i, (t, n) in enumerate(zip(tensors, names))]
        for h in handles:
            hvd.synchronize(h)

    def mode_grp() -> None:
        hvd.grouped_allreduce_(tensors, name="grads", op=hvd.Average)

    def optimizer_buckets(alloc: Callable[[int, torch.dtype], torch.Tensor], prefix: str) -> Callable[[], None]:
        # DistributedOptimizer's flat gradients: the tensors as views of one flat buffer made by
        # ``alloc``, in its 25 MiB buckets, one grouped in-place allreduce each
        params = [torch.empty(s, dtype=tensors[0].dtype).requires_grad_() for s in shapes]
        groups, views = flat_buckets(params, alloc=alloc)
        for v in views.values():
            v.fill_(1)
        buckets = [[views[p] for p in g] for g in groups]

        def step() -> None:
            hs = [hvd.grouped_allreduce_async_(b, name=f"{prefix}.{i}", op=hvd.Average)
                  for i, b in enumerate(buckets)]
            for h in hs:
                hvd.synchronize(h)
        return step

    def held(size: int, step: Callable[[], None]) -> Callable[[], None]:
        # ``step`` with the piece size held at ``size`` and the engine's piece-size follower
        # (``engine/pieces.py``) counting nothing meanwhile. The tunables are the engine thread's:
        # a step's handles complete before its round ends, where the follower may still set the
        # piece size; a small allreduce completes in a later round, after that one ended, so the
        # size is held only from then on (else a rank could plan the held step with the
        # follower's size and its peer with the held one: mismatched MPI calls)
        eng = get_context().engine
        one = torch.zeros(1)

        def run() -> None:
            hvd.allreduce_(one, name="held.after_the_round")
            follower, tun = eng.pieces, eng.tunables
            saved, floor = tun.chunk_bytes, None if follower is None else follower.min_bytes
            if follower is not None:
                follower.min_bytes = 1 << 62
            tun.chunk_bytes = size
            try:
                step()
            finally:
                tun.chunk_bytes = saved
                if follower is not None and floor is not None:
                    follower.min_bytes = floor
        return run

    def forced(way: bool) -> Callable[[], None]:
        # hvd with the executor's timed small-pages choice (choice.TimedChoice) forced one way
        ex = get_context().engine.runner.executor
        chooser = getattr(ex, "small_pages", None)

        def step() -> None:
            if chooser is None:  # a tree without the timed choice: copies, as it always did
                mode_hvd()
                return
            pick = chooser.pick
            chooser.pick = lambda batch: way
            try:
                mode_hvd()
            finally:
                chooser.pick = pick
        return step

    def core_mode(arrays: list[np.ndarray], prefix: str, in_place: bool) -> Callable[[], None]:
        keys = [f"{prefix}.{i}" for i in range(len(arrays))]
        submit = hvd_np.allreduce_async_ if in_place else hvd_np.allreduce_async

        def step() -> None:
            hs = [submit(a, name=k, op=hvd_np.Average) for a, k in zip(arrays, keys)]
            for h in hs:
                hvd_np.synchronize(h)
        return step

    every: dict[str, Callable[[], Callable[[], None]]] = {
        "flat": lambda: raw_schedules.flat(comm, flat, raw.setdefault("flat", {})),
        "pieces": lambda: raw_schedules.pieces(comm, flat, CHUNK, raw.setdefault("pieces", {})),
        "pieces-mul": lambda: raw_schedules.pieces(comm, flat, CHUNK, raw.setdefault("pieces-mul", {}), True),
        "pieces16": lambda: raw_schedules.pieces(comm, flat, 16 << 20, raw.setdefault("pieces16", {})),
        "sched": lambda: raw_schedules.schedule(comm, [t.numpy() for t in tensors], huge_page_backed, CHUNK,
                                                huge_page_empty, raw.setdefault("sched", {})),
        "sched-own": lambda: raw_schedules.schedule(comm, [t.numpy() for t in tensors], lambda a: True, CHUNK,
                                                    huge_page_empty, raw.setdefault("sched-own", {})),
        "sched-64k": lambda: raw_schedules.schedule(comm, [t.numpy() for t in tensors], lambda a: True, CHUNK,
                                                    huge_page_empty, raw.setdefault("sched-64k", {}), 64 << 10),
        "sched-256k": lambda: raw_schedules.schedule(comm, [t.numpy() for t in tensors], lambda a: True, CHUNK,
                                                     huge_page_empty, raw.setdefault("sched-256k", {}), 256 << 10),
        "sched-1m": lambda: raw_schedules.schedule(comm, [t.numpy() for t in tensors], lambda a: True, CHUNK,
                                                   huge_page_empty, raw.setdefault("sched-1m", {}), 1 << 20),
        "whole-256k": lambda: raw_schedules.schedule(comm, [t.numpy() for t in tensors], lambda a: True, CHUNK,
                                                     huge_page_empty, raw.setdefault("whole-256k", {}), 256 << 10,
                                                     1 << 30),
        "whole-16k": lambda: raw_schedules.schedule(comm, [t.numpy() for t in tensors], lambda a: True, CHUNK,
                                                    huge_page_empty, raw.setdefault("whole-16k", {}), 16 << 10,
                                                    1 << 30),
        "pert": lambda: raw_schedules.per_tensor(comm, [t.numpy() for t in tensors], raw.setdefault("pert", {})),
        "hvd": lambda: mode_hvd,
        "grp": lambda: mode_grp,
        "hvd-late": lambda: mode_hvd_late_wake,
        "opt": lambda: optimizer_buckets(huge_page_zeros, "opt"),
        "opt-zeros": lambda: optimizer_buckets(lambda n, dt: torch.zeros(n, dtype=dt), "optz"),
        "opt-2m": lambda: held(2 << 20, optimizer_buckets(huge_page_zeros, "opt2m")),
        "opt-16m": lambda: held(16 << 20, optimizer_buckets(huge_page_zeros, "opt16m")),
        "hvd-copy": lambda: forced(False),
        "hvd-own": lambda: forced(True),
        "core": lambda: core_mode([t.numpy() for t in tensors], "core", True),
        "np": lambda: core_mode([np.ones(s, np.float32) for s in shapes], "np", True),
        "np-oop": lambda: core_mode([np.ones(s, np.float32) for s in shapes], "oop", False),
    }
    unknown = set(args.modes.split(",")) - set(every)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {sorted(every)}")
    modes = {k: every[k]() for k in args.modes.split(",")}
    # Warm-up interleaved like the measured steps: every mode's names are cached in the first
    # repetition (a new cache slot empties the engine's step memo, and with it the executor's
    # timed trials), so the later warm-up repetitions finish those trials before measuring.
    for _ in range(args.warmup):
        for fn in modes.values():
            fn()
    ms: dict[str, list[float]] = {k: [] for k in modes}
    mpi_ms: dict[str, list[float]] = {k: [] for k in modes}
    faults: dict[str, list[int]] = {k: [] for k in modes}
    parts: dict[str, dict[str, list[float]]] = {k: {} for k in modes}
    calls: dict[str, list[str]] = {k: [] for k in modes}
    tunables = get_context().engine.tunables
    # the piece size the engine ran each step with (the follower's choice; a held mode's own)
    piece_mib: dict[str, list[int]] = {k: [] for k in modes if k not in raw and k not in ("opt-2m", "opt-16m")}
    for _ in range(args.reps):
        for k, fn in modes.items():
            comm.Barrier()
            _acc.clear()
            _spans.clear()
            for p in raw.values():
                p.clear()
            where.update(in_place=0, buffered=0)
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            step = (t1 - t0) * 1e3
            ms[k].append(step)
            if k in piece_mib:
                piece_mib[k].append(tunables.chunk_bytes >> 20)
            faults[k].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            if k in raw:
                mine = {p: v * 1e3 for p, v in raw[k].items()}
            else:
                mine = {p: v[0] * 1e3 for p, v in _acc.items()}
                calls[k].append(f"{where['in_place']}/{where['buffered']}")
            mpi_ms[k].append(mine.get("mpi", 0.0))
            if args.phases:
                if _spans:  # before the first batch, between batches (negotiation etc.), after the last
                    inside = sum(e - b for b, e in _spans)
                    mine["before"] = (_spans[0][0] - t0) * 1e3
                    mine["after"] = (t1 - _spans[-1][1]) * 1e3
                    mine["between"] = (_spans[-1][1] - _spans[0][0] - inside) * 1e3 - mine.get("negotiation", 0.0)
                    calls[k][-1] += f"/{len(_spans)}"
                mine["rest"] = step - sum(mine.values())
                for p, v in mine.items():
                    parts[k].setdefault(p, []).append(v)
    huge = 0
    with open("/proc/self/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("AnonHugePages"):
                huge = int(line.split()[1]) // 1024
    inner = comm.gather(mpi_ms, 0)
    follower = get_context().engine.pieces
    if rank != 0:
        return
    med = {k: statistics.median(v) for k, v in ms.items()}
    ref = {r: med[r] for r in ("flat", "pieces", "sched") if r in med}
    if "pieces" in ms and "pieces16" in ms:  # each step against the faster raw piece size of its rep
        best = [min(a, b) for a, b in zip(ms["pieces"], ms["pieces16"])]
        extra = {"vs_best_pieces_per_rep": {k: round(statistics.median(x / b for x, b in zip(v, best)), 2)
                                            for k, v in ms.items()}}
    else:
        extra = {}
    print(json.dumps({"bench": "mpi_plane_steps", "model": args.model, "dtype": args.dtype, "np": size,
                      "load": [round(x, 1) for x in os.getloadavg()],
                      "median_ms": {k: round(v, 1) for k, v in med.items()},
                      **{f"vs_{r}": {k: round(v / base, 2) for k, v in med.items()} for r, base in ref.items()},
                      **extra, "anon_huge_MiB_rank0": huge,
                      "follower": None if follower is None else list(follower.applied)}), flush=True)
    for k in modes:
        print(f"{k:9s} ms    ", " ".join(f"{x:.0f}" for x in ms[k]))
        if k in piece_mib:
            print(f"{k:9s} MiB   ", " ".join(str(x) for x in piece_mib[k]))
        for r, per_rank in enumerate(inner or []):
            print(f"{k:9s} mpi{r}  ", " ".join(f"{x:.0f}" for x in per_rank[k]))
        print(f"{k:9s} faults", " ".join(str(x) for x in faults[k]))
        for p, vs in parts[k].items():
            print(f"{k:9s} {p:7s}", " ".join(f"{x:.1f}" for x in vs))
        if args.phases and calls[k]:
            print(f"{k:9s} in/buf/batches", " ".join(calls[k]))


if __name__ == "__main__":
    main()
