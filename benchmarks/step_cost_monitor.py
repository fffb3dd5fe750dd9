"""The monitor's and the counters' cost per step, for ``benchmarks/step_cost.py --monitor`` (and the
timer helpers its ``--flight`` mode shares): blocks with every rank's monitor reporter running and
stopped, paired, with a bootstrap interval; each counting function timed where it runs."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import horovod.torch as hvd


def _timed(obj: Any, attr: str, acc: list[float]) -> None:
    """Wrap ``obj.attr`` (an instance attribute from now on) to add each call's seconds and count
    to ``acc`` = [seconds, calls, thread CPU seconds]."""
    inner = getattr(obj, attr)

    def timed(*a: Any, **k: Any) -> Any:
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            acc[0] += time.perf_counter() - t0
            acc[1] += 1
            acc[2] += time.thread_time() - c0

    setattr(obj, attr, timed)


def timer_floor() -> float:
    """Seconds a timed call of an empty function costs beyond the call itself (subtracted)."""
    acc = [0.0, 0, 0.0]

    class _Empty:
        def f(self) -> None:
            pass

    e = _Empty()
    _timed(e, "f", acc)
    for _ in range(20000):
        e.f()
    return acc[0] / acc[1]


def _bootstrap(ratios: list[float], n: int = 5000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the median of ``ratios`` (resampled with replacement)."""
    import numpy as np

    r = np.asarray(ratios)
    idx = np.random.default_rng(seed).integers(0, len(r), size=(n, len(r)))
    meds = np.median(r[idx], axis=1)
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def counter_costs(modes: dict[str, Callable[[], None]], steps: int, comm: Any) -> dict[str, Any]:
    """What the engine's counters (always on: ``hvd.metrics()``) cost per step of each mode: every
    call of the counting functions timed where it runs, with real arguments, less the timer's own
    cost; and the straggler exchange's time per second."""
    from horovod.common.context import get_context

    engine = get_context().engine
    floor = timer_floor()
    # (the metrics observer's batch_run is one of the runner's hooks: taken again once wrapped)
    parts = {"count_batch": (engine._metrics, "batch_run"), "record_round": (engine.metrics, "record_round"),
             "step_done": (engine.metrics, "step_done")}
    out: dict[str, Any] = {"timer_floor_us": round(floor * 1e6, 3)}
    for label, fn in modes.items():
        accs = {k: [0.0, 0, 0.0] for k in parts}
        for k, (obj, attr) in parts.items():
            _timed(obj, attr, accs[k])
        engine._observe()
        comm.Barrier()
        for _ in range(steps):
            fn()
        comm.Barrier()
        for obj, attr in parts.values():
            delattr(obj, attr)
        engine._observe()
        per_step = sum(max(a[0] - a[1] * floor, 0.0) for a in accs.values()) / steps
        out[label] = {"counter_us_per_step": round(per_step * 1e6, 2),
                      "calls_per_step": {k: round(a[1] / steps, 2) for k, a in accs.items()}}
    return out


def report_loopback_cpu(pushes: int = 200) -> float:
    """CPU seconds of one report, both ends: this rank's snapshot, JSON, signature and HTTP
    request, and the monitor service's parsing, check and ingest, with the service in this
    process (``time.process_time`` counts every thread of it)."""
    from horovod.common import reporter as rep_mod
    from horovod.common.context import get_context
    from horovod.common.rendezvous import RendezvousClient, make_secret
    from horovod.runner.monitor.service import MonitorService

    secret = make_secret()
    svc = MonitorService(secret, 0, "127.0.0.1")
    try:
        rep = rep_mod.Reporter(RendezvousClient("127.0.0.1", svc.port, secret, timeout=5.0),
                               get_context().engine.metrics_snapshot,
                               rank=hvd.rank(), local_rank=hvd.local_rank(), host="bench")
        rep.push()
        c0 = time.process_time()
        for _ in range(pushes):
            rep.push()
        cpu = (time.process_time() - c0) / pushes
        assert rep.sent == pushes + 1 and svc.state.reports == pushes + 1
        return cpu
    finally:
        svc.stop()


def monitor_on_off(modes: dict[str, Callable[[], None]], reps: int, block_s: float, comm: Any) -> None:
    """Alternate blocks with the monitor reporter on and off (the same ranks, one run); each block
    runs every mode in turn for ``block_s`` seconds, long enough to hold the reporter's pushes.

    Adjacent blocks pair up (on, off, off, on, ...: pairs (0, 1), (3, 2), ...); each pair gives
    the ratio of its on block's median step time to its off block's, per mode and for the sum of
    the modes' medians (``step``), and of this rank's CPU time per step over the block, every
    thread counted (``cpu_per_step``: what the reporter's thread adds shows there, and machine
    load only where it makes MPI spin longer). Rank 0 prints the median of the pairs' ratios with a bootstrap
    95% interval, the reporter's CPU per second (every push timed in the reporter's thread), the
    counters' cost per step and the straggler exchange's time per second."""
    from horovod.common import reporter as rep_mod
    from horovod.common.context import get_context

    ctx = get_context()
    assert ctx.reporter is not None, "run under horovodrun --monitor-port (no monitor to report to)"
    ctx.reporter.stop(final=False)
    ctx.reporter = None
    parts = counter_costs(modes, 200, comm)
    exchange = [0.0, 0, 0.0]
    _timed(ctx.engine._metrics, "exchange", exchange)
    push = [0.0, 0, 0.0]  # seconds, pushes, reporter thread CPU seconds
    on_seconds = 0.0
    times: dict[tuple[str, bool], list[float]] = {(m, on): [] for m in modes for on in (True, False)}
    block_medians: dict[str, list[tuple[bool, float]]] = {m: [] for m in modes}
    cpu_blocks: list[tuple[bool, float]] = []  # (on, this rank's CPU seconds per step: all threads)
    t_start = time.perf_counter()
    for block in range(4 * max(1, reps // 100)):
        on = block % 4 in (0, 3)  # on, off, off, on, ...: neither state always comes first
        if on and ctx.reporter is None:
            ctx.reporter = rep_mod.from_env(ctx.environ, ctx.engine.metrics_snapshot, hvd.rank(),
                                            hvd.local_rank())
            _timed(ctx.reporter, "push", push)
        elif not on and ctx.reporter is not None:
            ctx.reporter.stop(final=False)
            ctx.reporter = None
        comm.Barrier()
        t_block, c_block = time.perf_counter(), time.process_time()
        end = comm.bcast(time.perf_counter() + block_s if hvd.rank() == 0 else None)
        block: dict[str, list[float]] = {m: [] for m in modes}
        while True:
            for label, fn in modes.items():
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                block[label].append(time.perf_counter() - t0)
            if comm.bcast(time.perf_counter() >= end if hvd.rank() == 0 else None):
                break
        cpu_blocks.append((on, (time.process_time() - c_block) / sum(len(v) for v in block.values())))
        if on:
            on_seconds += time.perf_counter() - t_block
        for label, ts in block.items():
            times[(label, on)].extend(ts)
            block_medians[label].append((on, statistics.median(ts)))
    run_seconds = time.perf_counter() - t_start
    if ctx.reporter is not None:
        ctx.reporter.stop(final=False)
        ctx.reporter = None
    loopback = report_loopback_cpu() if hvd.rank() == 0 else 0.0
    if hvd.rank() == 0:
        n_blocks = len(next(iter(block_medians.values())))
        first = block_medians[next(iter(modes))]
        step_bm = [(first[b][0], sum(block_medians[k][b][1] for k in modes)) for b in range(n_blocks)]
        out: dict[str, Any] = {"np": hvd.size(), "block_s": block_s, "blocks": n_blocks,
                               "pushes_rank0": push[1],
                               "report_ms_per_push": round(push[0] / max(push[1], 1) * 1e3, 3),
                               "report_cpu_ms_per_push": round(push[2] / max(push[1], 1) * 1e3, 3),
                               "report_cpu_ms_per_s": round(push[2] / max(on_seconds, 1e-9) * 1e3, 4),
                               "report_cpu_ms_both_ends": round(loopback * 1e3, 3),
                               "exchanges": exchange[1],
                               "exchange_ms_per_s": round(exchange[0] / run_seconds * 1e3, 4),
                               "counters": parts}

        def paired(bm: list[tuple[bool, float]]) -> list[float]:
            return [bm[i][1] / bm[i + 1][1] if bm[i][0] else bm[i + 1][1] / bm[i][1]
                    for i in range(0, len(bm) - 1, 2)]

        for label, bm in [*block_medians.items(), ("step", step_bm), ("cpu_per_step", cpu_blocks)]:
            pairs = paired(bm)
            lo, hi = _bootstrap(pairs)
            row: dict[str, Any] = {"ratio_paired_median": round(statistics.median(pairs), 4),
                                   "ratio_ci95": [round(lo, 4), round(hi, 4)], "pairs": len(pairs)}
            if label in modes:
                on_ms = statistics.median(times[(label, True)]) * 1e3
                off_ms = statistics.median(times[(label, False)]) * 1e3
                row.update(on_ms=round(on_ms, 3), off_ms=round(off_ms, 3),
                           ratio_pooled_median=round(on_ms / off_ms, 4),
                           steps=len(times[(label, True)]))
            row["block_ms"] = [round(v * 1e3, 3) for _, v in bm]
            out[label] = row
        print(json.dumps(out), flush=True)
