"""The 161-tiny-tensor step on the Gloo and the MPI plane in the same processes, phase by phase,
beside the raw transports' own latency (docs/performance.md, "Both planes in one job").

    mpirun -np 2 --oversubscribe --bind-to none python benchmarks/tiny_step_planes.py --blocks 4 --reps 200
    ... --work-ms 2      # 2 ms of the caller's own busy work before each step (a training step's
                         # compute: the caller's thread hot, the transports' threads idle)
    ... --barrier mpi    # an MPI barrier before each step on both planes (gloo: a Gloo one)
    ... --async          # grouped_allreduce_async_ + synchronize (its submission wakes the engine
                         # thread) instead of the synchronous grouped_allreduce_ (which does not)
    ... --variant ATTR   # experiment in a patched tree: every block on Gloo, every other one with
                         # the Gloo backend's attribute ATTR set to True

One ``mpirun`` job. The engine is started ``--blocks`` times, on the Gloo plane and the MPI plane in
turn (``hvd.init()`` / ``hvd.shutdown()``; on Gloo the MPI launcher's variables are hidden and the
ranks meet as torchrun's would, on a port rank 0 picks): both planes see the same load, in blocks
seconds apart. Every rep starts with a barrier, by default the plane's own as in ``step_cost.py``:
on Gloo an allreduce of one integer on a Gloo process group of the benchmark's own (it releases
the ranks up to half a millisecond apart), on MPI ``MPI_Barrier`` (microseconds apart). The other
plane's barrier would bias the comparison on a loaded 2-core host: after an MPI barrier Gloo's
next call waits milliseconds for its threads, and after a Gloo barrier the MPI rank that comes
early polls the core its late peer needs. Then
times, each mode in its own run of ``--reps`` reps (``--interleave``: every mode in turn in every
rep; a raw call right after an engine step waits for threads the step left busy):

* ``grouped``: one ``hvd.grouped_allreduce_`` (``--async``: ``grouped_allreduce_async_`` and
  ``synchronize``) of the 161 tensors of 4 floats (a cached step), with
  every phase marked on every rank (wall and thread CPU time): submission, the round's bits and
  row, the exchange (on Gloo: the send call, posting the next receives, the waits), reading the
  rows, plan, the batch's run, completion;
* ``gloo_rows``: one raw exchange of a row as long as the carried negotiation's (a send to the
  peer, the receive posted during the previous one) on the benchmark's Gloo group;
* ``gloo_small`` / ``gloo_fused``: one raw ``ProcessGroupGloo.allreduce`` of 4 floats / of the fused
  buffer's 644 floats on that group;
* ``mpi_small`` / ``mpi_fused``: one raw mpi4py ``Allreduce`` of the same.

Each figure is the median over a block's reps of the time from the last rank's start to the last
rank's end (the ranks' clocks are the host's CLOCK_MONOTONIC); the phases are medians per rank, the
rank that entered the exchange last being "late". Rank 0 prints one JSON line per block and a
summary per pair of blocks (Gloo, then MPI): Gloo's step less MPI's, and less one raw Gloo
exchange as well.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import statistics
import time
from typing import Any

import numpy as np
import torch

PHASES = [("submit and hand-off to the round", "start", "drive<"),
          ("bits and row", "agree<", "xchg<"),
          ("exchange", "xchg<", "xchg>"), ("post the sends (+ the next receives)", "xchg<", "rwait<"),
          ("exchange to the send", "xchg<", "send<"), ("the send call", "send<", "send>"),
          ("the send to posting the next receives", "send>", "post<"), ("posting a receive", "post<", "post>"),
          ("posted to the wait", "post>", "rwait<"),
          ("wait for receives", "rwait<", "rwait>"), ("receives to send waits", "rwait>", "swait<"),
          ("wait for sends", "swait<", "swait>"), ("send waits to the exchange's end", "swait>", "xchg>"),
          ("read rows", "xchg>", "agree>"),
          ("agree to plan", "agree>", "execute<"), ("plan", "execute<", "run<"), ("run", "run<", "run>"),
          ("run to complete", "run>", "complete<"), ("complete", "complete<", "complete>"),
          ("after the round", "drive>", "end"), ("step", "start", "end")]
_HIDDEN = ("OMPI_", "PMIX_", "PMI_", "MPI_LOCALNRANKS")


def _hide_mpi() -> dict[str, str]:
    """Take the MPI launcher's variables out of the environment (hvd.init() then meets on Gloo)."""
    return {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(_HIDDEN)}


def _raw_gloo(comm: Any, rank: int, size: int, port: int) -> Any:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=60))
    comm.Barrier()
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = datetime.timedelta(seconds=60)
    return store, dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, size, opts)


def _free_port(comm: Any) -> int:
    import socket

    port = 0
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    return int(comm.bcast(port, root=0))


def _instrument(ev: list[tuple[str, float, float]]) -> None:
    """``step_timeline.py``'s timers on the running engine's methods, each event with the thread's
    CPU time too (this script runs from ``benchmarks/``, where ``step_timeline`` is importable)."""
    from step_timeline import instrument

    from horovod.common.context import get_context

    clock, cpu = time.perf_counter, time.thread_time
    instrument(get_context().engine, lambda label: ev.append((label, clock(), cpu())))


def block(plane: str, args: Any, comm: Any, pg: Any, steps: int, posted: list[Any],
          variant: bool = False) -> dict[str, Any]:
    """One engine's life on ``plane``: warm-up, then ``steps`` reps of every mode. ``posted``: the
    raw exchange's receives posted ahead (kept from block to block: Gloo matches a peer's messages
    to the receives in the order they were posted)."""
    import horovod.torch as hvd
    from horovod.common.context import get_context

    rank, size = comm.Get_rank(), comm.Get_size()
    hidden: dict[str, str] = {}
    if plane == "gloo":
        hidden = _hide_mpi()
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
                           "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(_free_port(comm))})
    try:
        hvd.init()
    finally:
        if plane == "gloo":
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                os.environ.pop(k, None)
            os.environ.update(hidden)
    eng: Any = get_context().engine
    assert eng.backend.name == plane, eng.backend.name
    ev: list[tuple[str, float, float]] = []
    _instrument(ev)
    if args.variant and plane == "gloo" and variant:
        setattr(eng.backend, args.variant, True)
    tensors = [torch.ones(args.elements) for _ in range(args.tensors)]
    n_fused = args.tensors * args.elements
    carrier = eng.rounds.carrier
    small_t, fused_t = torch.ones(args.elements), torch.ones(n_fused)
    small_a, fused_a = np.ones(args.elements, np.float32), np.ones(n_fused, np.float32)
    small_o, fused_o = np.empty_like(small_a), np.empty_like(fused_a)
    peers = [j for j in range(size) if j != rank]

    def grouped() -> None:
        ev.append(("start", time.perf_counter(), time.thread_time()))
        if args.use_async:  # the submission wakes the engine thread; the caller then drives
            hvd.synchronize(hvd.grouped_allreduce_async_(tensors, name="planes.grouped", op=hvd.Average))
        else:  # the synchronous call submits without waking it (the caller drives at once)
            hvd.grouped_allreduce_(tensors, name="planes.grouped", op=hvd.Average)
        ev.append(("end", time.perf_counter(), time.thread_time()))

    # The carried row's length on the Gloo plane (header + data); the same bytes on MPI's.
    data = 16 * args.tensors * -(-args.elements // 4)  # each tensor's bytes padded to 8
    row_n = 8 * (2 * eng.cache.words + 3) + (1 << (data - 1).bit_length())  # (the carrier's capacity)
    row = torch.zeros(row_n, dtype=torch.uint8)

    def post() -> list[Any]:
        out = torch.empty(size, row_n, dtype=torch.uint8)
        return [pg.recv([out[j]], j, 0x5254) for j in peers]

    if not posted:
        posted.extend([post(), row])

    def gloo_rows() -> None:
        sends = [pg.send([row], j, 0x5254) for j in peers]
        for w in posted[0]:
            w.wait()
        for w in sends:
            w.wait()
        posted[0] = post()

    modes = {"grouped": grouped, "gloo_rows": gloo_rows,
             "gloo_small": lambda: pg.allreduce([small_t]).wait(),
             "gloo_fused": lambda: pg.allreduce([fused_t]).wait(),
             "mpi_small": lambda: comm.Allreduce(small_a, small_o),
             "mpi_fused": lambda: comm.Allreduce(fused_a, fused_o)}
    if args.modes:
        modes = {k: f for k, f in modes.items() if k in args.modes.split(",")}
    one = torch.zeros(1, dtype=torch.int64)
    kind = args.barrier if args.barrier != "own" else plane
    barrier = comm.Barrier if kind == "mpi" else lambda: pg.allreduce([one]).wait()
    spans: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    events: list[list[tuple[str, float, float]]] = []
    # Each mode in its own run of reps (a raw call right after an engine step, or after another
    # transport's, waits for threads that step left busy: up to milliseconds on a loaded host);
    # --interleave: every rep runs every mode once, in turn.
    runs = [list(modes.items())] if args.interleave else [[m] for m in modes.items()]
    for run in runs:
        for rep in range(args.warmup + steps):
            for label, fn in run:
                barrier()
                if args.work_ms:  # a training step's compute: this thread busy, the transport's idle
                    until = time.perf_counter() + args.work_ms / 1e3
                    while time.perf_counter() < until:
                        pass
                ev.clear()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                if rep >= args.warmup:
                    spans[label].append((t0, t1))
                    if label == "grouped":
                        events.append(list(ev))
    rounds = carrier.rounds if carrier is not None else None
    hvd.shutdown()
    every_spans = comm.gather(spans, root=0)
    every_events = comm.gather(events, root=0)
    if rank != 0:
        return {}
    out: dict[str, Any] = {"plane": plane + ("+" + args.variant if variant else ""), "barrier": args.barrier,
                           "work_ms": args.work_ms, "load": round(os.getloadavg()[0], 2),
                           "rounds": rounds}
    for m in modes:
        starts = np.array([[s for s, _ in r[m]] for r in every_spans])
        ends = np.array([[e for _, e in r[m]] for r in every_spans])
        out[m] = round(float(np.median(ends.max(0) - starts.max(0))) * 1e3, 4)
    out["phases"] = phases(every_events)
    return out


def phases(every: list[list[list[tuple[str, float, float]]]]) -> dict[str, float]:
    """Per rank, the median of each phase over the reps in which every rank drove one round; the
    rank that entered the exchange last is "late", the other "early" (np=2)."""
    rows: dict[str, list[float]] = collections.defaultdict(list)
    for reps in zip(*every):
        if any(sum(1 for n, _, _ in r if n == "drive<") != 1 for r in reps):
            rows["reps not driven once by the caller"].append(1.0)
            continue
        first = [{n: t for n, t, _ in reversed(r)} for r in reps]
        cpu = [{n: c for n, _, c in reversed(r)} for r in reps]
        late = max(range(len(first)), key=lambda i: first[i]["xchg<"])
        for me, at in enumerate(first):
            who = "late" if me == late else "early"
            for label, a, b in PHASES:
                if a in at and b in at:
                    rows[f"{who}: {label}"].append((at[b] - at[a]) * 1e3)
                    rows[f"{who} CPU: {label}"].append((cpu[me][b] - cpu[me][a]) * 1e3)
            for peer in first:
                if peer is not at and "rwait>" in at and "send>" in peer:
                    rows[f"{who}: receive done after the peer's send"].append((at["rwait>"] - peer["send>"]) * 1e3)
        rows["early entered the exchange before late by"].append(
            (first[late]["xchg<"] - min(a["xchg<"] for a in first)) * 1e3)
        rows["last end - last start"].append((max(a["end"] for a in first) - max(a["start"] for a in first)) * 1e3)
    return {k: round(statistics.median(v), 4) if not k.startswith("reps") else len(v) for k, v in rows.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=6, help="engine starts, Gloo and MPI in turn")
    p.add_argument("--reps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--tensors", type=int, default=161)
    p.add_argument("--elements", type=int, default=4)
    p.add_argument("--work-ms", type=float, default=0.0,
                   help="milliseconds of busy work between the barrier and each mode (a training "
                        "step's compute: the caller's thread busy, the transports' threads idle)")
    p.add_argument("--interleave", action="store_true", help="every rep runs every mode in turn")
    p.add_argument("--modes", default="", help="comma-separated modes to time (default: all)")
    p.add_argument("--variant", default="", help="experiment: every block on Gloo, every other one "
                   "with this attribute of the Gloo backend set to True")
    p.add_argument("--async", dest="use_async", action="store_true",
                   help="grouped_allreduce_async_ + synchronize instead of grouped_allreduce_")
    p.add_argument("--barrier", choices=("own", "mpi", "gloo"), default="own",
                   help="what every rep starts with: the plane's own (default; as step_cost.py under "
                        "horovodrun --gloo and under mpirun), an MPI barrier, or an allreduce of one "
                        "integer on the benchmark's Gloo group")
    args = p.parse_args()
    from mpi4py import MPI  # (here: importing this module starts no MPI)

    comm = MPI.COMM_WORLD
    if comm.Get_size() < 2:
        raise SystemExit("run it under mpirun -np 2 (or more)")
    store, pg = _raw_gloo(comm, comm.Get_rank(), comm.Get_size(), _free_port(comm))
    results = []
    posted: list[Any] = []
    for b in range(args.blocks):
        if args.variant:  # experiment: Gloo blocks without and with the variant, in turn
            res = block("gloo", args, comm, pg, args.reps, posted, variant=b % 2 == 1)
        else:
            res = block("gloo" if b % 2 == 0 else "mpi", args, comm, pg, args.reps, posted)
        if comm.Get_rank() == 0:
            print(json.dumps(res), flush=True)
            results.append(res)
    if posted:  # the receives posted ahead for an exchange that never came: one last send
        sends = [pg.send([posted[1]], j, 0x5254) for j in range(comm.Get_size()) if j != comm.Get_rank()]
        for w in posted[0] + sends:
            w.wait()
    comm.Barrier()
    del posted, pg, store
    if comm.Get_rank() == 0:
        print(json.dumps(summary(results)), flush=True)


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per pair of blocks (Gloo, then MPI), the differences the goal reads, and their medians."""
    pairs = [(g, m) for g, m in zip(results[0::2], results[1::2])]
    diff = [round(g["grouped"] - m["grouped"], 4) for g, m in pairs]
    over_raw = [round(g["grouped"] - m["grouped"] - g["gloo_rows"], 4) for g, m in pairs]
    return {"summary": True, "gloo_grouped": [g["grouped"] for g, _ in pairs],
            "mpi_grouped": [m["grouped"] for _, m in pairs],
            "gloo_rows": [g["gloo_rows"] for g, _ in pairs],  # (each raw figure from its own plane's block)
            "gloo_small": [g.get("gloo_small") for g, _ in pairs], "mpi_small": [m.get("mpi_small") for _, m in pairs],
            "mpi_fused": [m.get("mpi_fused") for _, m in pairs],
            "gloo_minus_mpi": diff, "gloo_minus_mpi_minus_rows": over_raw,
            "median_gloo_minus_mpi": statistics.median(diff) if diff else None,
            "median_gloo_minus_mpi_minus_rows": statistics.median(over_raw) if over_raw else None,
            "loads": [r["load"] for r in results]}


if __name__ == "__main__":
    main()
