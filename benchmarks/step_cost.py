"""The engine's fixed cost of one training step: 161 tiny tensors, so the transport costs nothing.

    mpirun -np 2 python benchmarks/step_cost.py                  # torch (DistributedOptimizer's path)
    mpirun -np 2 python benchmarks/step_cost.py --profile step.prof   # rank 0 profiles one mode
    mpirun -np 2 python benchmarks/step_cost.py --phases    # rank 0: time per phase of a step
    mpirun -np 2 python benchmarks/step_cost.py --ab --reps 50   # the step-cost fixes on against
                 # off, interleaved (modes *_unopt)
    horovodrun -np 2 --monitor-port 0 python benchmarks/step_cost.py --monitor --reps 2000 \
        --monitor-block-s 2   # monitor on vs off: paired blocks, median ratio + bootstrap 95%
                              # interval, the counters' cost per step, the reporter's CPU per push
    HOROVOD_MONITOR_INTERVAL=0.1 horovodrun ... --monitor-block-s 0.5   # the same at 10 reports/s
    mpirun -np 2 -x HOROVOD_TORCH_CPU_PLANE=1 python benchmarks/step_cost.py   # the torch device
                 # plane (its CPU twin): every mode but bundle (host tensors only)
    mpirun -np 2 python benchmarks/step_cost.py --modes async_sync,hooks,grouped --slope 21
                 # the cost of one more tensor: 161 against 21 tensors, interleaved
    horovodrun --gloo -np 2 python benchmarks/step_cost.py \
        --modes async_sync,hooks,grouped,raw,floor,floor_and
                 # the Gloo data plane: ranks meet in a Gloo barrier; raw, floor and floor_and
                 # run on a Gloo process group of their own beside the engine's; --carry adds
                 # *_nocarry modes (the carried negotiation's data off on every rank)
    mpirun -np 2 --bind-to none python benchmarks/step_cost.py --reps 300 --flight \
        --modes async_sync,hooks,bundle,optimizer,grouped
                 # the flight recorder on against off (modes *_noflight), interleaved

Modes (interleaved, each rep runs every mode once; medians reported by rank 0 as JSON):
  async_sync   ``hvd.allreduce_async_`` per tensor, then ``hvd.synchronize`` per handle (what
               ``DistributedOptimizer`` does in its hooks and ``step()``)
  hooks        exactly ``DistributedOptimizer``'s per-gradient path after its first step: a hook
               resubmits each gradient's checked request with ``defer=True`` (``_resubmit``),
               ``step()`` synchronizes each handle (the engine sees the whole burst at once)
  bundle       the same requests resubmitted as one bundle at the end of the backward pass
               (``_resubmit_many``: one engine submission, one handle), then one ``synchronize``:
               ``DistributedOptimizer``'s path where the engine holds the hooks' gradients until
               ``step()`` anyway (``HOROVOD_OVERLAP_GRADIENTS=0``, or auto on a host with fewer
               than two cores per local rank)
  optimizer    a real ``hvd.DistributedOptimizer`` step (zero_grad, backward of a loss over 161
               parameters, step); ``plain`` is the same step with the bare torch optimizer on a
               copy of the model, and ``optimizer_overhead`` the median per-rep difference: what
               Horovod adds to a training step
  optimizer_groups1  the same step with ``hvd.DistributedOptimizer(..., groups=1)``: one grouped
               allreduce of every gradient (``optimizer_groups1_overhead`` against ``plain``)
  grouped      one ``hvd.grouped_allreduce_`` of the 161 tensors
  raw          ``torch.distributed``-free floor: one mpi4py ``Allreduce`` per tensor (the transport)
  floor        one reduction of all the elements in one buffer on the mode's transport (mpi4py;
               the plane's Gloo process group on the twin; a Gloo group of its own under
               ``horovodrun --gloo``); ``*_us_per_tensor`` is a mode's time less this floor, per
               tensor: Horovod's host cost per tensor
  floor_and    one bitwise AND of the negotiation's bit vector (cache slots ready, slots to evict,
               flags: ``2 * HOROVOD_CACHE_CAPACITY / 64 + 1`` words) on the same transport: what
               a cached step's negotiation costs on the wire; ``floor`` + ``floor_and`` is the
               transport's share of a grouped step that negotiates and reduces in two calls

``*_marginal_us_per_tensor`` (``--slope N``): the cost of one more tensor, from the same modes
run interleaved on N tensors: the median over the reps of the step less the small set's step
(each less its time in the transport), divided by the difference in tensors. The step's fixed
costs (a round's negotiation, waiting for the peer, the transport's latency) cancel out, which
the per-tensor figures above divide among the tensors. At np=1 nothing waits for a peer and the
figures repeat to a few percent on a loaded machine: the way to compare the twin's per-tensor
work with the host path's (``python benchmarks/step_cost.py --slope 21`` with and without
``HOROVOD_TORCH_CPU_PLANE=1``).

``*_host_us_per_tensor`` is the same cost measured without the floor: each step less the time it
spent inside the data transport's calls (the host backend's ``allreduce``, or the plane's Gloo
reductions, timed where the engine makes them), per tensor, median over the steps. Read it on the
twin: there a Gloo call right after a blocking MPI call (``floor`` follows an MPI barrier) can wait
milliseconds for the peer process to be scheduled, which makes ``floor`` larger than the whole
step on a 2-core host.

``--monitor`` and the timer helpers live beside this file in ``step_cost_monitor.py``.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_cost_monitor import monitor_on_off, timer_floor  # noqa: E402

import horovod.torch as hvd  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--tensors", type=int, default=161)
parser.add_argument("--elements", type=int, default=4)
parser.add_argument("--slope", type=int, default=0, metavar="N",
                    help="also run async_sync, hooks and grouped on a set of N tensors (modes *_small, "
                         "interleaved) and report *_marginal_us_per_tensor: the median over the reps of "
                         "(step - small step) / (tensors - N), each less its time in the transport: the "
                         "cost of one more tensor, without the step's fixed costs")
parser.add_argument("--reps", type=int, default=300)
parser.add_argument("--modes", default="", help="comma-separated modes to time (default: all)")
parser.add_argument("--profile", default="", help="write a cProfile of --profile-mode on rank 0")
parser.add_argument("--profile-mode", default="async_sync")
parser.add_argument("--ab", action="store_true",
                    help="also run each mode with the step-cost fixes switched off in the same processes "
                         "(modes *_unopt, interleaved): fusion-plan memo, plan_reduction memo, one-call "
                         "pack/unpack, inlined resubmission, and the optimizer's bundles "
                         "(optimizer_unopt); e.g. mpirun -np 2 python benchmarks/step_cost.py --ab "
                         "--reps 50")
parser.add_argument("--flight", action="store_true",
                    help="also run each mode with the flight recorder off (HOROVOD_FLIGHT_RECORDER=0) in "
                         "the same processes (modes *_noflight, interleaved), and report "
                         "*_flight_cost_pct: the median per-rep step with it on less off, in percent of "
                         "the median step with it off (*_flight_cpu_cost_pct: the same in this process's "
                         "CPU time, less sensitive to a loaded machine)")
parser.add_argument("--carry", action="store_true",
                    help="on Gloo: also run each mode with the carried negotiation's data off on every rank "
                         "(modes *_nocarry, interleaved: the rows still carry the bits, every reduction "
                         "takes a Gloo call; see horovod/common/engine/carry.py)")
parser.add_argument("--monitor", action="store_true",
                    help="under horovodrun --monitor-port: alternate blocks of --monitor-block-s seconds "
                         "with every rank's monitor reporter running and stopped (4 blocks per 100 "
                         "--reps); paired ratios with a bootstrap interval, and the parts' costs")
parser.add_argument("--monitor-block-s", type=float, default=2.0)
parser.add_argument("--phases", action="store_true",
                    help="also time each phase of a step (submission, AND, fusion plan, execution, "
                         "completion) for async_sync and grouped, with timers around engine methods")


def _wrap(obj: Any, attr: str, label: str, acc: dict[str, float]) -> None:
    fn = getattr(obj, attr)

    def timed(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t0

    setattr(obj, attr, timed)


def _unopt_switch() -> Callable[[bool], None]:
    """A switch between this change's step-cost fixes and the code they replaced (for --ab): the
    batch runner's fusion-plan memo, the executor's ``plan_reduction`` memo, the buffers'
    one-call pack/unpack, and the repeat path's inlined resubmission (the hooks' and the
    optimizer's: a generic check of the tensor against its signature, a fresh NumPy view and a
    separate handle registration instead)."""
    from horovod.common.context import get_context, peek_context
    from horovod.common.engine import fusion, plan
    from horovod.torch import _dense_reducer, _repeat, mpi_ops

    eng = get_context().engine
    assert eng is not None
    runner, ex = eng.runner, eng._executor
    ops = ex._ops
    fast: dict[str, Any] = {"plan": runner.plan, "calls": ex._plan_reduction, "resubmit": _repeat._resubmit}

    def plan_unmemoized(responses: Any, _slots: Any, _joined: Any) -> Any:
        tun = eng.tunables
        return fusion.plan_batches(responses, tun.fusion_threshold, tun.max_tensor_bytes,
                                   not eng.config.disable_group_fusion)

    def resubmit(tensor: Any, signature: Any, wake: bool = True, defer: bool = False) -> Any:
        ctx, prepared, _dtype, _shape, group, probe, (_, ps_id, _), memo = signature
        if (memo.host and type(tensor) is torch.Tensor and _repeat._PROBE(tensor) == probe
                and tensor.is_contiguous() and ctx is peek_context() and ctx.groups.get(ps_id) is group):
            buf = [tensor.numpy()]
            return mpi_ops._register(prepared.submit(buf, buf, None, wake, defer), _repeat._Same(tensor))
        return _repeat._resubmit(tensor, signature, wake, defer)  # (the plane's: as it is)

    slow: dict[str, Any] = {"plan": plan_unmemoized, "calls": plan.plan_reduction, "resubmit": resubmit}
    where = {"plan": [(runner, "plan")], "calls": [(ex, "_plan_reduction")],
             "resubmit": [(mpi_ops, "_resubmit"), (_dense_reducer, "_resubmit")]}

    def switch(optimized: bool) -> None:
        for key, places in where.items():
            for obj, attr in places:
                setattr(obj, attr, (fast if optimized else slow)[key])
        if optimized:
            ops.__dict__.pop("pack", None)
            ops.__dict__.pop("unpack", None)
        else:
            ops.__dict__.update(pack=ops.pack_each, unpack=ops.unpack_each)

    return switch


def phases(modes: dict[str, Callable[[], Any]], tensors: list[Any], names: list[str], reps: int,
           barrier: Callable[[], None]) -> dict[str, dict[str, float]]:
    """Per-step milliseconds of each phase (this rank), for the async_sync, hooks and grouped modes:
    timers around the round controller's AND, the batch runner's fusion plan (with its memo: a
    hit costs the lookup) and completion, and the executor's run."""
    from horovod.common.context import get_context

    eng = get_context().engine
    assert eng is not None
    acc: dict[str, float] = collections.defaultdict(float)
    _wrap(eng.backend, "and_bits", "negotiation AND (incl. waiting for peers)", acc)
    _wrap(eng.runner.executor, "run", "execution (pack, reduce, unpack)", acc)
    _wrap(eng.runner, "complete", "completion (results, wake waiters)", acc)
    _wrap(eng.runner, "plan", "fusion plan", acc)
    out = {}
    for label in ("async_sync", "hooks", "grouped"):
        per_rep: dict[str, list[float]] = collections.defaultdict(list)
        for _ in range(reps):
            acc.clear()
            barrier()
            t0 = time.perf_counter()
            if label == "async_sync":
                handles = [hvd.allreduce_async_(t, name=n, op=hvd.Average) for t, n in zip(tensors, names)]
            elif label == "hooks":
                handles = modes["hooks_submit"]()
            else:
                handles = [hvd.grouped_allreduce_async_(tensors, name="grouped.grads", op=hvd.Average)]
            acc["submission"] += time.perf_counter() - t0
            t1 = time.perf_counter()
            for h in handles:
                hvd.synchronize(h)
            acc["synchronize (everything after submission)"] += time.perf_counter() - t1
            for k, v in acc.items():
                per_rep[k].append(v)
        # Medians per phase (a rep's phases need not be that rep's median step).
        out[label] = {k: round(statistics.median(v + [0.0] * (reps - len(v))) * 1e3, 3)
                      for k, v in per_rep.items()}
    return out


def _plane_group() -> Any:
    """The torch device plane's process group of the global set (the CPU twin), or None."""
    from horovod.common.context import get_context

    eng = get_context().engine
    plane = getattr(getattr(eng, "_executor", None), "planes", None)
    for p in getattr(plane, "_planes", {}).values() if plane is not None else ():
        for tr in getattr(p, "_transports", {}).values():
            return tr.pg
    return None


def transport_timer() -> tuple[list[float], Callable[[], None]]:
    """Seconds spent inside the data transport's reductions since the list was last cleared
    (``acc[0]``): the plane's Gloo reductions on the twin, else the host backend's ``allreduce``;
    and the function that takes the timers off again (before ``hvd.shutdown()``: a wrapper
    stored on its transport is a reference cycle that would keep the plane's process group, and
    its worker threads, alive into the interpreter's exit)."""
    from horovod.common.context import get_context

    eng = get_context().engine
    acc = [0.0]
    planes = getattr(getattr(eng, "_executor", None), "planes", None)
    targets = [tr for p in getattr(planes, "_planes", {}).values() for tr in getattr(p, "_transports", {}).values()]
    attr = "_reduce" if targets else "allreduce"
    for obj in targets or [eng.backend]:
        inner = getattr(obj, attr)

        def timed(*a: Any, _inner: Any = inner, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                acc[0] += time.perf_counter() - t0

        setattr(obj, attr, timed)
    wrapped = targets or [eng.backend]

    def remove() -> None:
        for obj in wrapped:
            obj.__dict__.pop(attr, None)
    return acc, remove


def steps_from_last(spans: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    """Per mode, the median over the reps of (the last rank's end - the last rank's start), in ms:
    the step as the rank that leaves the barrier last sees it, with every rank's end counted
    (``*_from_last_ms``). A Gloo barrier releases the ranks up to half a millisecond apart on a
    loaded host (each wait ends with thread wake-ups; MPI's spins), and the early rank's step then
    holds that skew as waiting for its peer. Only where every rank is on this host (the clock is
    then the same: ``time.perf_counter`` is CLOCK_MONOTONIC); {} elsewhere."""
    if hvd.size() == 1 or hvd.local_size() != hvd.size():
        return {}
    labels = list(spans)
    mine = torch.tensor([[t for m in labels for span in spans[m] for t in span]], dtype=torch.float64)
    every = hvd.allgather(mine, name="step_cost.spans").reshape(hvd.size(), len(labels), -1, 2)
    last = every.amax(0)  # (modes, reps, [start, end])
    return {m: float((last[i, :, 1] - last[i, :, 0]).median()) * 1e3 for i, m in enumerate(labels)}


def _raw_rows(pg: Any, engine: Any) -> Callable[[], None] | None:
    """One raw exchange of the carried negotiation's row on ``pg`` (see ``floor_rows``), or None
    where the engine carries nothing (``HOROVOD_GLOO_CARRY_BYTES=0``)."""
    carrier = engine.rounds.carrier
    if carrier is None:
        return None
    n = 8 * (2 * engine.cache.words + 3) + carrier.capacity
    me, size = hvd.rank(), hvd.size()
    row = torch.zeros(n, dtype=torch.uint8)
    peers = [j for j in range(size) if j != me]

    def post() -> list[Any]:
        out = torch.empty(size, n, dtype=torch.uint8)
        return [pg.recv([out[j]], j, 0x5254) for j in peers]

    posted = [post()]

    def floor_rows() -> None:
        sends = [pg.send([row], j, 0x5254) for j in peers]
        for w in posted[0]:
            w.wait()
        for w in sends:
            w.wait()
        posted[0] = post()
    return floor_rows


def _bench_gloo_group() -> Any:
    """A Gloo process group of the job's world beside the engine's own (``horovodrun --gloo``)."""
    from horovod.common.context import get_context

    backend = get_context().engine.backend
    return backend._make_pg("bench.step_cost", hvd.rank(), hvd.size())


def per_tensor_modes(tensors: list[Any], prefix: str) -> dict[str, Any]:
    """The per-tensor modes on ``tensors`` (names made with ``prefix``): ``async_sync``, ``hooks``
    (where the tree resubmits these tensors' signatures) and ``grouped``, plus the hooks' pieces."""
    from horovod.common.context import get_context
    from horovod.torch import mpi_ops
    from horovod.torch.mpi_ops import _repeat_signature

    names = [f"{prefix}grad.{i}" for i in range(len(tensors))]

    def async_sync() -> None:
        handles = [hvd.allreduce_async_(t, name=n, op=hvd.Average) for t, n in zip(tensors, names)]
        for h in handles:
            hvd.synchronize(h)

    def grouped() -> None:
        hvd.grouped_allreduce_(tensors, name=f"{prefix}grouped.grads", op=hvd.Average)

    # The optimizer's hooks: the first step checks and submits, later ones resubmit deferred.
    first = [hvd.allreduce_async_(t, name=f"{prefix}hook.{i}", op=hvd.Average) for i, t in enumerate(tensors)]
    sigs = [_repeat_signature(t, get_context().handles[h][0].request) for t, h in zip(tensors, first)]
    # Trees from before the device plane's repeat path have no signatures for the plane's tensors
    # (HOROVOD_TORCH_CPU_PLANE=1): the modes built on them are left out there. Bundles are for
    # host signatures only (the plane's are resubmitted one by one).
    repeat = all(s is not None for s in sigs)
    host_sigs = repeat and all(len(s) < 8 or s[7].host for s in sigs)  # type: ignore[index, union-attr]
    for h in first:
        hvd.synchronize(h)

    def hooks_submit() -> list[Any]:
        resubmit = mpi_ops._resubmit  # looked up per step: --ab swaps it
        return [resubmit(t, s, defer=True) for t, s in zip(tensors, sigs)]  # type: ignore[arg-type]

    def hooks() -> None:
        for h in hooks_submit():
            hvd.synchronize(h)

    modes: dict[str, Any] = {"async_sync": async_sync, "grouped": grouped, "hooks_submit": hooks_submit,
                             "_repeat": repeat, "_host_sigs": host_sigs, "_sigs": sigs}
    if repeat:
        modes["hooks"] = hooks
    return modes


def main() -> None:
    args = parser.parse_args()
    hvd.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    tensors = [torch.ones(args.elements) for _ in range(args.tensors)]
    names = [f"grad.{i}" for i in range(args.tensors)]
    from horovod.torch import mpi_ops

    own = per_tensor_modes(tensors, "")
    async_sync, grouped, hooks_submit = own["async_sync"], own["grouped"], own["hooks_submit"]
    repeat, host_sigs, sigs, hooks = own["_repeat"], own["_host_sigs"], own["_sigs"], own.get("hooks")

    def bundle() -> None:
        hvd.synchronize(mpi_ops._resubmit_many(tensors, sigs, defer=True))  # type: ignore[arg-type]

    arrays = [t.numpy() for t in tensors]
    # Under ``horovodrun --gloo`` mpi4py sees a world of one: the ranks meet in a Gloo barrier,
    # and ``raw``, ``floor`` and ``floor_and`` run on a Gloo process group of their own, made on
    # the job's store beside the engine's (the same device and transport, its own pairs).
    gloo = _bench_gloo_group() if comm.Get_size() != hvd.size() else None

    def raw() -> None:
        if gloo is not None:
            for t in tensors:
                gloo.allreduce([t]).wait()
            return
        for a in arrays:
            comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)

    # The transport's floor for the fused step: one reduction of all the tensors' elements in one
    # buffer, on the transport the mode runs on (mpi4py on the host path; the plane's own Gloo
    # process group on the twin, which the grouped step has made by now).
    flat = torch.ones(args.tensors * args.elements)
    grouped()
    plane = _plane_group()

    def floor() -> None:
        if plane is not None:
            plane.allreduce([flat]).wait()
        elif gloo is not None:
            gloo.allreduce([flat]).wait()
        else:
            comm.Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)

    # The negotiation's own collective: a bitwise AND of the engine's bit vector (cache slots
    # ready, slots to evict, flags), on the same transport as ``floor``.
    from horovod.common.context import get_context

    and_bits = np.zeros(2 * get_context().engine.cache.words + 1, np.uint64)
    and_out = np.empty_like(and_bits)

    def floor_and() -> None:
        if gloo is not None:
            o = torch.distributed.AllreduceOptions()
            o.reduceOp = torch.distributed.ReduceOp.BAND
            gloo.allreduce([torch.from_numpy(and_bits.view(np.int64))], o).wait()
        else:
            comm.Allreduce(and_bits, and_out, op=MPI.BAND)

    # Under Gloo: one raw exchange of the carried negotiation's row (its length now: the header
    # and the agreed capacity) on the bench group, as the engine makes it: each rank's row sent to
    # every peer with the receives posted after the previous exchange (``GlooBackend.post_rows``).
    floor_rows = _raw_rows(gloo, get_context().engine) if gloo is not None else None

    # A real optimizer step; the bare optimizer on a copy of the model costs the same autograd.
    def model() -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(torch.ones(args.elements)) for _ in range(args.tensors)]

    x = torch.ones(args.elements)
    hvd_params, plain_params, group_params = model(), model(), model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(hvd_params, lr=0.0),
                                   named_parameters=[(f"param.{i}", p) for i, p in enumerate(hvd_params)])
    group_opt = hvd.DistributedOptimizer(torch.optim.SGD(group_params, lr=0.0), groups=1,
                                         named_parameters=[(f"gparam.{i}", p) for i, p in enumerate(group_params)])
    plain_opt = torch.optim.SGD(plain_params, lr=0.0)
    if hvd.size() == 1:  # one rank needs no reduction, so the optimizer has no hooks: add them
        opt.reducer.register_hooks()  # type: ignore[attr-defined]
        group_opt.reducer.register_hooks()  # type: ignore[attr-defined]

    def train_step(o: Any, params: list[torch.nn.Parameter]) -> None:
        o.zero_grad()
        torch.stack([(p * x).sum() for p in params]).sum().backward()
        o.step()

    def optimizer() -> None:
        train_step(opt, hvd_params)

    def plain() -> None:
        train_step(plain_opt, plain_params)

    def optimizer_groups1() -> None:  # DistributedOptimizer(groups=1): one grouped allreduce
        train_step(group_opt, group_params)

    for _ in range(3):  # the first steps take the checked path; later ones resubmit
        optimizer()
        optimizer_groups1()
    modes: dict[str, Callable[[], None]] = {"async_sync": async_sync, "hooks": hooks, "bundle": bundle,  # type: ignore[dict-item]
                                            "optimizer": optimizer, "optimizer_groups1": optimizer_groups1,
                                            "plain": plain, "grouped": grouped, "raw": raw, "floor": floor,
                                            "floor_and": floor_and}
    if floor_rows is not None:
        modes["floor_rows"] = floor_rows
    if not hasattr(mpi_ops, "_resubmit_many") or not host_sigs:  # a tree from before bundles
        modes.pop("bundle")
    if not repeat:
        modes.pop("hooks")
    if args.slope:  # the same per-tensor modes on a smaller set, interleaved (see --slope)
        small = per_tensor_modes([torch.ones(args.elements) for _ in range(args.slope)], "small.")
        for k in ("_repeat", "_host_sigs", "_sigs", "hooks_submit"):
            small.pop(k)
        modes.update({f"{k}_small": f for k, f in small.items()})
    if args.ab:
        switch = _unopt_switch()

        def switched(fn: Callable[[], None], optimized: bool) -> Callable[[], None]:
            def run() -> None:
                switch(optimized)
                try:
                    fn()
                finally:
                    switch(True)
            return run

        def unbundled() -> None:
            # The optimizer's gradients submitted one by one (each deferred), as before bundling.
            opt.reducer._collect = lambda _p, _s: False  # type: ignore[attr-defined]
            try:
                switched(optimizer, False)()
            finally:
                del opt.reducer._collect  # type: ignore[attr-defined]

        local = ("raw", "plain", "floor", "floor_and", "floor_rows")
        modes = {**{k: switched(f, True) for k, f in modes.items() if k not in local},
                 **{f"{k}_unopt": switched(f, False) for k, f in modes.items() if k not in local},
                 "optimizer_unopt": unbundled, **{k: modes[k] for k in local}}
    if args.flight:
        from horovod.common.context import get_context

        eng = get_context().engine
        recorder = eng.flight
        assert recorder is not None, "the flight recorder is off (HOROVOD_FLIGHT_RECORDER=0)"

        def flight(fn: Callable[[], None], on: bool) -> Callable[[], None]:
            def run() -> None:
                eng.flight = recorder if on else None
                try:
                    fn()
                finally:
                    eng.flight = recorder
            return run

        local = ("raw", "plain", "floor", "floor_and", "floor_rows")
        paired: dict[str, Callable[[], None]] = {}
        for k, f in modes.items():  # each mode next to its twin (see the swap in the loop below)
            if k not in local:
                paired[k], paired[f"{k}_noflight"] = flight(f, True), flight(f, False)
        modes = {**paired, **{k: modes[k] for k in local if k in modes}}
    if args.carry:
        from horovod.common.context import get_context

        carrier = get_context().engine.rounds.carrier
        assert carrier is not None, "no carried negotiation here (Gloo, np > 1, HOROVOD_GLOO_CARRY_BYTES > 0)"

        def carry(fn: Callable[[], None], on: bool) -> Callable[[], None]:
            def run() -> None:
                carrier.enabled = on
                try:
                    fn()
                finally:
                    carrier.enabled = True
            return run

        local = ("raw", "plain", "floor", "floor_and", "floor_rows")
        paired = {}
        for k, f in modes.items():
            if k not in local:
                paired[k], paired[f"{k}_nocarry"] = carry(f, True), carry(f, False)
        modes = {**paired, **{k: modes[k] for k in local if k in modes}}
    if args.modes:
        keep = set(args.modes.split(",")) | ({"plain"} if any(m.startswith("optimizer") for m in args.modes.split(","))
                                            else set())
        modes = {k: f for k, f in modes.items() if k in keep or k.removesuffix("_unopt") in keep
                 or k.removesuffix("_small") in keep or k.removesuffix("_noflight") in keep
                 or k.removesuffix("_nocarry") in keep}
    if args.monitor:
        monitor_on_off({k: modes[k] for k in ("async_sync", "bundle", "optimizer", "grouped") if k in modes},
                       args.reps, args.monitor_block_s, comm)
        hvd.shutdown()
        return
    if gloo is not None:
        one = torch.zeros(1, dtype=torch.int64)

        def barrier() -> None:  # an allreduce: ordered with the group's other collectives
            gloo.allreduce([one]).wait()
    else:
        barrier = comm.Barrier
    times: dict[str, list[float]] = {m: [] for m in modes}
    spans: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}  # (start, end) per rep
    host: dict[str, list[float]] = {m: [] for m in modes}  # each step less its time in the transport
    cpu: dict[str, list[float]] = {m: [] for m in modes}  # this process's CPU seconds per step
    in_transport, untime = transport_timer()
    for rep in range(args.reps + 20):
        # With --flight, every other rep swaps each mode with its twin: neither the recorder's on
        # nor its off variant always runs first, and both follow the same mode.
        order = list(modes.items())
        if args.flight and rep % 2:
            for i in range(len(order) - 1):
                if order[i + 1][0] == f"{order[i][0]}_noflight":
                    order[i], order[i + 1] = order[i + 1], order[i]
        for label, fn in order:
            barrier()
            in_transport[0] = 0.0
            c0 = time.process_time()
            t0 = time.perf_counter()
            fn()
            if rep >= 20:
                t1 = time.perf_counter()
                dt = t1 - t0
                spans[label].append((t0, t1))
                cpu[label].append(time.process_time() - c0)
                times[label].append(dt)
                host[label].append(dt - in_transport[0])
    untime()
    from_last = steps_from_last(spans)
    flight_calls: dict[str, Any] = {}
    if args.flight:
        # The recorder's own work per step, timed where it runs (every call of batch_done, less
        # the timer's cost; the median call, so that a call the machine preempted does not count
        # as the recorder's): what it adds, free of the machine's noise, in percent of the step.
        from horovod.common.context import get_context

        recorder = get_context().engine.flight
        floor_s = timer_floor()
        inner = recorder.batch_done
        for label, fn in modes.items():
            if label.endswith("_noflight") or f"{label}_noflight" not in modes:
                continue
            calls: list[float] = []

            def timed(*a: Any, _calls: list[float] = calls) -> None:
                t0 = time.perf_counter()
                inner(*a)
                _calls.append(time.perf_counter() - t0)

            recorder.batch_done = timed
            comm.Barrier()
            for _ in range(100):
                fn()
            comm.Barrier()
            del recorder.batch_done
            us = max(statistics.median(calls) - floor_s, 0.0) * len(calls) / 100 * 1e6
            step_us = statistics.median(times[f"{label}_noflight"]) * 1e6
            flight_calls[label] = {"us_per_step": round(us, 3), "calls_per_step": len(calls) / 100,
                                   "pct_of_step": round(us / step_us * 100, 4)}
    if args.profile:
        prof = cProfile.Profile()
        fn = modes[args.profile_mode]
        for _ in range(50):
            barrier()
            if hvd.rank() == 0:
                prof.enable()
            fn()
            if hvd.rank() == 0:
                prof.disable()
        if hvd.rank() == 0:
            prof.dump_stats(args.profile)
    if hvd.rank() == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        for mode in ("optimizer", "optimizer_unopt", "optimizer_groups1"):
            if mode in times and "plain" in times:
                med[mode.replace("optimizer", "optimizer_overhead")] = statistics.median(
                    a - b for a, b in zip(times[mode], times["plain"])) * 1e3
        # Horovod's host cost per tensor: the step less the transport's floor, per tensor.
        per_tensor = {f"{k}_us_per_tensor": round((med[k] - med["floor"]) * 1e3 / args.tensors, 3)
                      for k in ("async_sync", "hooks", "grouped") if k in med and "floor" in med}
        per_tensor.update({f"{k}_host_us_per_tensor": round(statistics.median(host[k]) * 1e6 / args.tensors, 3)
                           for k in ("async_sync", "hooks", "grouped") if k in host})
        for k in ("async_sync", "hooks", "grouped"):
            if f"{k}_small" in host:
                per_tensor[f"{k}_marginal_us_per_tensor"] = round(statistics.median(
                    a - b for a, b in zip(host[k], host[f"{k}_small"])) * 1e6 / (args.tensors - args.slope), 3)
        for k in list(times):
            if f"{k}_noflight" in times:  # paired per rep: both ran in the same rep, in turn
                on_off = [a - b for a, b in zip(times[k], times[f"{k}_noflight"])]
                per_tensor[f"{k}_flight_cost_pct"] = round(
                    statistics.median(on_off) / statistics.median(times[f"{k}_noflight"]) * 100, 2)
                on_off = [a - b for a, b in zip(cpu[k], cpu[f"{k}_noflight"])]
                per_tensor[f"{k}_flight_cpu_cost_pct"] = round(
                    statistics.median(on_off) / statistics.median(cpu[f"{k}_noflight"]) * 100, 2)
        if args.flight:
            per_tensor["flight_recorder"] = flight_calls
        print(json.dumps({"np": hvd.size(), "tensors": args.tensors, "elements": args.elements,
                          "plane": plane is not None, **{f"{k}_ms": round(v, 3) for k, v in med.items()},
                          **per_tensor, **{f"{k}_from_last_ms": round(v, 3) for k, v in from_last.items()}}),
              flush=True)
    if args.phases:
        split = phases({**modes, "hooks_submit": hooks_submit}, tensors, names, args.reps, barrier)
        if hvd.rank() == 0:
            print(json.dumps({"phases_ms_per_step": split}), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
