"""A gradient set on the Gloo data plane against DDP's way, raw Gloo schedules and a breakdown.

    horovodrun --gloo -np 2 python benchmarks/gloo_gradsync.py --model resnet50
    horovodrun --gloo -np 2 python benchmarks/gloo_gradsync.py --modes hvd,ddp-bucket --reps 15

Every mode runs in the same processes, one after the other in each repetition (after a barrier on
the raw process group; each repetition starts one mode later), so machine noise hits them alike. Raw modes run on a
``torch.distributed`` Gloo process group of their own (``init_process_group`` on a port rank 0
picks), the one DDP would use:

  ddp-bucket     DDP's way: gradients copied into 25 MiB flat buckets (last layers first), every
                 bucket's ``all_reduce`` started asynchronously, then each waited for, divided and
                 copied back
  ddp-view       the same buckets as views of one flat buffer (DDP's ``gradient_as_bucket_view``):
                 no copies, only the reductions and the division
  raw-flat       one ``all_reduce`` of one flat buffer of the same size, then /size
  raw-seq-<k>    the flat buffer in k MiB pieces, one blocking ``all_reduce`` after the other
  raw-pipe-<k>   the same pieces, all started asynchronously, then waited for in order
  hvd            horovod.torch ``allreduce_async_`` of each gradient, then ``synchronize`` each
                 (what ``DistributedOptimizer`` does)
  hvd-grouped    one ``grouped_allreduce_`` of all gradients
  hvd-flat       ``grouped_allreduce_`` of gradients that are views of one flat tensor
  hvd-views      ``allreduce_async_`` of each of those views, then ``synchronize`` each
  hvd, hvd-grouped, hvd-flat run with the engine's default piece sizes (on Gloo 16 MiB pieces,
                 tensors of 1 MiB and more reduced where they lie; ``GlooBackend.piece_sizes``)
  hvd-c<k>, hvd-grouped-c<k>, hvd-flat-c<k>   with pieces of k MiB as ``HOROVOD_CHUNK_BYTES``
                 set by a user (every tensor below one piece packed; --chunks). ``hvd-c2`` is
                 the Gloo plane's schedule before its own piece sizes (the MPI plane's 2 MiB)
  hvd-c<k>a<m>   hvd with pieces of k MiB, tensors of m MiB and more calls of their own (--alone)
  hvd-p<d>, hvd-flat-p<d>   hvd / hvd-flat with d reductions in flight (``HOROVOD_GLOO_PIPELINE``,
                 default 2; --depths)
  *-before       an hvd mode with the engine as before the Gloo plane's pipelining: one reduction
                 at a time, tensors on 4 KiB pages copied through the fusion buffer

Rank 0 prints one JSON line per mode: the median ms, the ratio to ``ddp-bucket``, and for the
hvd modes the breakdown of a step (median per step, ms): ``transport`` (inside the Gloo backend's
collective calls; with pipelined pieces, starting them and blocking until each ends), ``copy``
(packing into and unpacking out of fusion buffers, scaling included), ``scale`` (scaling in the
tensors' own memory: Average's division of what was reduced in place, prescaling) and ``other``
(the rest: submission, negotiation, the engine thread's wake-up, synchronize). ``--json FILE`` appends them
to a file. The load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import MODELS  # noqa: E402

import horovod.torch as hvd  # noqa: E402

BUCKET_MIB = 25
PIECES_MIB = "2,8,25"

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default="resnet50", choices=sorted(MODELS))
parser.add_argument("--reps", type=int, default=12)
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--modes", default="", help="comma-separated subset of the modes (default: all)")
parser.add_argument("--pieces", default=PIECES_MIB, help="piece sizes (MiB) of the raw-seq/raw-pipe modes")
parser.add_argument("--chunks", default="1,4,8", help="piece sizes (MiB) of the hvd-c<k> / hvd-flat-c<k> modes")
parser.add_argument("--alone", default="0.5,1,2",
                    help="sizes (MiB) from which tensors are calls of their own, for hvd-c<k>a<m> modes")
parser.add_argument("--depths", default="1,3,4", help="reductions in flight of the hvd-p<d> modes")
parser.add_argument("--json", default=None, help="append the results to this file (rank 0)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def buckets_of(tensors: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """DDP's bucketing: last layers first, a bucket closed once it holds ``cap_bytes``."""
    out: list[list[torch.Tensor]] = []
    cur: list[torch.Tensor] = []
    for t in reversed(tensors):
        cur.append(t)
        if sum(x.numel() * x.element_size() for x in cur) >= cap_bytes:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


class Breakdown:
    """Seconds a step spends in the Gloo backend's collectives and in fusion-buffer copies
    (wrapped on the engine's objects; ``remove`` restores them)."""

    def __init__(self) -> None:
        from horovod.common.context import get_context

        eng = get_context().engine
        self.acc = {"transport": 0.0, "copy": 0.0, "scale": 0.0}
        ex = getattr(eng, "_executor", None)
        self._wrapped: list[tuple[Any, str]] = []
        self._wrap(eng.backend, "allreduce", "transport")
        if hasattr(eng.backend, "allreduce_start"):  # pipelined: starting, and waiting for the end
            self._wrap(eng.backend, "allreduce_start", "transport", waits=True)
        ops = getattr(ex, "_ops", None)
        if ops is not None:
            for name in ("pack", "unpack"):
                self._wrap(ops, name, "copy")
            self._wrap(ops, "scale", "scale")  # in place: Average's division, prescaling

    def _wrap(self, obj: Any, attr: str, key: str, waits: bool = False) -> None:
        inner = getattr(obj, attr)
        acc = self.acc

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                out = inner(*a, **k)
            finally:
                acc[key] += time.perf_counter() - t0
            if not waits:
                return out

            def wait() -> None:
                t1 = time.perf_counter()
                try:
                    out()
                finally:
                    acc[key] += time.perf_counter() - t1
            return wait

        setattr(obj, attr, timed)
        self._wrapped.append((obj, attr))

    def reset(self) -> dict[str, float]:
        out = dict(self.acc)
        for k in self.acc:
            self.acc[k] = 0.0
        return out

    def remove(self) -> None:
        for obj, attr in self._wrapped:
            obj.__dict__.pop(attr, None)


def main() -> None:
    args = parser.parse_args()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(1)
    import torch.distributed as dist

    shapes = MODELS[args.model]()
    numel = sum(math.prod(s) for s in shapes)
    port = hvd.broadcast_object(_free_port() if rank == 0 else None, 0, name="gloo.port")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)

    modes: dict[str, Callable[[], None]] = {}
    # DDP's way, copied buckets
    grads = [torch.ones(s) for s in shapes]
    buckets = buckets_of(grads, BUCKET_MIB << 20)
    flats = [torch.zeros(sum(x.numel() for x in b)) for b in buckets]

    def ddp_bucket() -> None:
        works = []
        for b, f in zip(buckets, flats):
            torch.cat([x.reshape(-1) for x in b], out=f)
            works.append(dist.all_reduce(f, async_op=True))
        for b, f, w in zip(buckets, flats, works):
            w.wait()
            f.div_(size)
            o = 0
            for x in b:
                x.copy_(f[o:o + x.numel()].view_as(x))
                o += x.numel()

    modes["ddp-bucket"] = ddp_bucket
    # DDP's gradient_as_bucket_view: the buckets are the gradients' memory
    vflat = torch.ones(numel)
    cap = (BUCKET_MIB << 20) // 4
    vbuckets = [vflat[max(0, e - cap):e] for e in range(numel, 0, -cap)]

    def ddp_view() -> None:
        works = [dist.all_reduce(b, async_op=True) for b in vbuckets]
        for b, w in zip(vbuckets, works):
            w.wait()
            b.div_(size)

    modes["ddp-view"] = ddp_view
    raw = torch.ones(numel)

    def raw_flat() -> None:
        dist.all_reduce(raw)
        raw.div_(size)

    modes["raw-flat"] = raw_flat
    for k in (int(x) for x in args.pieces.split(",") if x):
        n = (k << 20) // 4
        pieces = [raw[s:s + n] for s in range(0, numel, n)]

        def seq(pieces: list[torch.Tensor] = pieces) -> None:
            for p in pieces:
                dist.all_reduce(p)
                p.div_(size)

        def pipe(pieces: list[torch.Tensor] = pieces) -> None:
            works = [dist.all_reduce(p, async_op=True) for p in pieces]
            for p, w in zip(pieces, works):
                w.wait()
                p.div_(size)

        modes[f"raw-seq-{k}"] = seq
        modes[f"raw-pipe-{k}"] = pipe

    tensors = [torch.ones(s) for s in shapes]
    names = [f"grad.{i}" for i in range(len(tensors))]

    def hvd_async() -> None:
        handles = [hvd.allreduce_async_(t, name=n, op=hvd.Average) for t, n in zip(tensors, names)]
        for h in handles:
            hvd.synchronize(h)

    def hvd_grouped() -> None:
        hvd.grouped_allreduce_(tensors, name="grads", op=hvd.Average)

    hflat = torch.ones(numel)
    views, o = [], 0
    for s in shapes:
        n = math.prod(s)
        views.append(hflat[o:o + n].view(s))
        o += n

    def hvd_flat() -> None:
        hvd.grouped_allreduce_(views, name="flat", op=hvd.Average)

    def hvd_views() -> None:
        handles = [hvd.allreduce_async_(t, name=f"view.{n}", op=hvd.Average) for t, n in zip(views, names)]
        for h in handles:
            hvd.synchronize(h)

    modes.update({"hvd": hvd_async, "hvd-grouped": hvd_grouped, "hvd-flat": hvd_flat, "hvd-views": hvd_views})
    from horovod.common.context import get_context

    eng = get_context().engine
    placement = eng._executor.placement

    def before(fn: Callable[[], None]) -> Callable[[], None]:
        """``fn`` with the engine as before the Gloo work: one reduction at a time, tensors
        on 4 KiB pages copied through the fusion buffer (set alike on every rank)."""
        def run() -> None:
            depth, pins = eng.backend.pipeline, placement._pins
            eng.backend.pipeline, placement._pins = 0, True
            try:
                fn()
            finally:
                eng.backend.pipeline, placement._pins = depth, pins
        return run

    modes.update({"hvd-before": before(hvd_async), "hvd-grouped-before": before(hvd_grouped),
                  "hvd-flat-before": before(hvd_flat)})

    def chunked(fn: Callable[[], None], nbytes: int, alone: int = 0) -> Callable[[], None]:
        """``fn`` with pieces of ``nbytes`` and tensors of ``alone`` bytes and more as calls of
        their own (0: as ``HOROVOD_CHUNK_BYTES`` set by a user: tensors below one piece packed);
        set alike on every rank."""
        def run() -> None:
            tun = eng.tunables
            saved = tun.chunk_bytes, tun.alone_bytes
            tun.chunk_bytes, tun.alone_bytes = nbytes, alone
            try:
                fn()
            finally:
                tun.chunk_bytes, tun.alone_bytes = saved
        return run

    for k in (float(x) for x in args.chunks.split(",") if x):
        modes[f"hvd-c{k:g}"] = chunked(hvd_async, int(k * 2**20))
        modes[f"hvd-grouped-c{k:g}"] = chunked(hvd_grouped, int(k * 2**20))
        modes[f"hvd-flat-c{k:g}"] = chunked(hvd_flat, int(k * 2**20))
        for m in (float(x) for x in args.alone.split(",") if x):
            modes[f"hvd-c{k:g}a{m:g}"] = chunked(hvd_async, int(k * 2**20), int(m * 2**20))
    def deep(fn: Callable[[], None], depth: int) -> Callable[[], None]:
        """``fn`` with ``depth`` reductions in flight (``HOROVOD_GLOO_PIPELINE``; alike on every rank)."""
        def run() -> None:
            saved, eng.backend.pipeline = eng.backend.pipeline, depth
            try:
                fn()
            finally:
                eng.backend.pipeline = saved
        return run

    for d in (int(x) for x in args.depths.split(",") if x):
        modes[f"hvd-p{d}"] = deep(hvd_async, d)
        modes[f"hvd-flat-p{d}"] = deep(hvd_flat, d)
    if args.modes:
        keep = args.modes.split(",")
        unknown = [m for m in keep if m not in modes]
        if unknown:
            raise SystemExit(f"unknown modes {unknown}; known: {sorted(modes)}")
        modes = {k: modes[k] for k in keep}

    for fn in modes.values():
        for _ in range(args.warmup):
            fn()
    brk = Breakdown()
    times: dict[str, list[float]] = {k: [] for k in modes}
    parts: dict[str, list[dict[str, float]]] = {k: [] for k in modes}
    loads = [os.getloadavg()[0]]
    order = list(modes.items())
    for rep in range(args.reps):
        # each repetition starts one mode later (the same order on every rank), so that no mode
        # always runs right after the same one
        at = rep % len(order)
        for k, fn in order[at:] + order[:at]:
            dist.barrier()
            brk.reset()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
            parts[k].append(brk.reset())
    loads.append(os.getloadavg()[0])
    brk.remove()
    if rank == 0:
        base = statistics.median(times["ddp-bucket"]) if "ddp-bucket" in times else None
        for k, ts in times.items():
            med = statistics.median(ts)
            row: dict[str, Any] = {"bench": "gloo_gradsync", "model": args.model, "np": size,
                                   "tensors": len(shapes), "MiB": round(numel * 4 / 2**20, 1), "mode": k,
                                   "median_ms": round(med * 1e3, 2), "min_ms": round(min(ts) * 1e3, 2),
                                   "load": [round(x, 2) for x in loads]}
            if base:
                row["ratio_to_ddp_bucket"] = round(med / base, 3)
            if k.startswith("hvd"):
                tr = [p["transport"] for p in parts[k]]
                cp = [p["copy"] for p in parts[k]]
                sc = [p["scale"] for p in parts[k]]
                row["transport_ms"] = round(statistics.median(tr) * 1e3, 2)
                row["copy_ms"] = round(statistics.median(cp) * 1e3, 2)
                row["scale_ms"] = round(statistics.median(sc) * 1e3, 2)
                row["other_ms"] = round(statistics.median(t - a - b - c for t, a, b, c in zip(ts, tr, cp, sc)) * 1e3, 2)
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
