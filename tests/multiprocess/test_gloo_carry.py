"""Cached small allreduces carried with the negotiation on Gloo (``engine/carry.py``), real ranks.

Every rank contributes different values and checks every element of every result against the
exact reduction, on np=2 and np=3: a grouped allreduce repeated (cached: after the capacity is
agreed its data travels with the round's bits and the transport's allreduce is never called),
per-tensor allreduces with Average and a prescale, mixed dtypes, Min/Max/Product, out of place;
and the fallbacks: ranks whose ready sets differ (rank 0 submits an extra tensor the others hold
back until the first is done), a tensor too large to carry, and the first (negotiated) step; and
that each exchange's receives were posted during the one before (``GlooBackend.post_rows``).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch, under_settings

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]


def _cases():
    import numpy as np
    import torch

    import horovod.torch as hvd
    from horovod.common.backends import gloo as gloo_backend
    from horovod.common.context import get_context
    from horovod.common.engine import buffers

    calls = {"allreduce": 0, "exchange": 0, "pack": 0}
    rows = {"exchanges": 0, "posted": 0, "posts": 0}  # over the whole run (shutdown included)
    sync, start, exchange = (gloo_backend.GlooBackend.allreduce, gloo_backend.GlooBackend.allreduce_start,
                             gloo_backend.GlooBackend.exchange_rows)
    post = gloo_backend.GlooBackend.post_rows

    def spy_sync(self, buf, op, group, src=None):
        calls["allreduce"] += 1
        return sync(self, buf, op, group, src)

    def spy_start(self, buf, op, group):
        calls["allreduce"] += 1
        return start(self, buf, op, group)

    def spy_exchange(self, row, post_next=0):
        calls["exchange"] += 1
        rows["exchanges"] += 1
        rows["posted"] += self._rows_posted is not None
        return exchange(self, row, post_next)

    pack = buffers._pack

    def spy_pack(*a):  # this rank's data copied into a fusion buffer
        calls["pack"] += 1
        return pack(*a)
    buffers._pack = spy_pack

    def spy_post(self, n):
        rows["posts"] += 1
        return post(self, n)
    gloo_backend.GlooBackend.allreduce = spy_sync
    gloo_backend.GlooBackend.allreduce_start = spy_start
    gloo_backend.GlooBackend.exchange_rows = spy_exchange
    gloo_backend.GlooBackend.post_rows = spy_post

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    carrier = get_context().engine.rounds.carrier
    bad: list[str] = []

    def value(k: int, i: int, step: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return ((torch.arange(numel, dtype=torch.float64) % 7) + 3 * k + i + step).to(dtype)

    def check(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.dtype != want.dtype or not torch.equal(got, want):
            at = int((got.reshape(-1) != want.reshape(-1)).nonzero()[0, 0]) if got.shape == want.shape else 0
            bad.append(f"rank {r} {label}: element {at} is {got.reshape(-1)[at].item()}, expected "
                       f"{want.reshape(-1)[at].item()}")

    shapes = [(4,), (3, 2), (1,), (5,), (2, 2, 2)]
    dtypes = [torch.float32, torch.float64, torch.int32, torch.float32, torch.int64]
    counts = []
    for step in range(8):
        if step == 3:
            calls["allreduce"] = calls["exchange"] = calls["pack"] = 0
            carried_before = carrier.carried_ops if carrier is not None else 0
        # grouped, Sum, one dtype
        ts = [value(r, i, step, int(np.prod(s)), torch.float32).reshape(s) for i, s in enumerate(shapes)]
        hvd.grouped_allreduce_(ts, name="carry.grouped", op=hvd.Sum)
        for i, (t, s) in enumerate(zip(ts, shapes)):
            want = sum(value(k, i, step, int(np.prod(s)), torch.float64) for k in range(n)).float().reshape(s)
            check(f"step {step} grouped tensor {i}", t, want)
        # per tensor, mixed dtypes, Average with a prescale (floats) and Sum (integers)
        ts = [value(r, i, step, int(np.prod(s)), d).reshape(s) for i, (s, d) in enumerate(zip(shapes, dtypes))]
        handles = []
        for i, (t, d) in enumerate(zip(ts, dtypes)):
            if d.is_floating_point:
                handles.append(hvd.allreduce_async_(t, name=f"carry.t{i}", op=hvd.Average, prescale_factor=2.0))
            else:
                handles.append(hvd.allreduce_async_(t, name=f"carry.t{i}", op=hvd.Sum))
        for h in handles:
            hvd.synchronize(h)
        for i, (t, s, d) in enumerate(zip(ts, shapes, dtypes)):
            total = sum(value(k, i, step, int(np.prod(s)), torch.float64) for k in range(n))
            want = (total * 2.0 / n if d.is_floating_point else total).to(d).reshape(s)
            check(f"step {step} tensor {i} {d}", t, want)
        # Min, Max, Product out of place
        x = value(r, 0, step, 6, torch.float64)
        for op, fn in ((hvd.Min, torch.minimum), (hvd.Max, torch.maximum), (hvd.Product, torch.mul)):
            got = hvd.allreduce(x, name=f"carry.op{op}", op=op)
            want = value(0, 0, step, 6, torch.float64)
            for k in range(1, n):
                want = fn(want, value(k, 0, step, 6, torch.float64))
            check(f"step {step} op {op}", got, want)
        counts.append(dict(calls))
    carried = carrier.carried_ops - carried_before if carrier is not None else 0
    steady = dict(calls)

    # Ranks that disagree: rank 0 submits "late" with "early"; the others hold "late" back until
    # "early" is done. Values must hold whichever round each runs in.
    fallback = []
    for step in range(4):
        early = value(r, 0, step, 4, torch.float32)
        late = value(r, 1, step, 4, torch.float32)
        if r == 0:
            h1 = hvd.allreduce_async_(early, name="carry.early", op=hvd.Sum)
            h2 = hvd.allreduce_async_(late, name="carry.late", op=hvd.Sum)
            hvd.synchronize(h1)
            hvd.synchronize(h2)
        else:
            hvd.allreduce_(early, name="carry.early", op=hvd.Sum)
            hvd.allreduce_(late, name="carry.late", op=hvd.Sum)
        check(f"disagree step {step} early", early, sum(value(k, 0, step, 4, torch.float64) for k in range(n)).float())
        check(f"disagree step {step} late", late, sum(value(k, 1, step, 4, torch.float64) for k in range(n)).float())
        # too large to carry (above HOROVOD_GLOO_CARRY_BYTES): through the transport
        big = value(r, 2, step, 3000, torch.float32)
        before = calls["allreduce"]
        hvd.allreduce_(big, name="carry.big", op=hvd.Sum)
        fallback.append(calls["allreduce"] - before)
        check(f"big step {step}", big, sum(value(k, 2, step, 3000, torch.float64) for k in range(n)).float())
    hvd.shutdown()
    return bad, steady, carried, fallback, rows


@pytest.mark.parametrize("np_", [2, 3])
def test_cached_small_allreduces_travel_with_the_negotiation(np_):
    for bad, steady, carried, fallback, rows in _LAUNCH[np_].results("carried"):
        assert not bad, bad
        # 5 steps of: 1 grouped + 5 per-tensor + 3 ops, every one carried, no allreduce call
        assert steady["allreduce"] == 0, steady
        assert carried == 5 * 9, carried
        # reduced from the rows into the fusion buffer: this rank's data is never packed there
        assert steady["pack"] == 0, steady
        assert steady["exchange"] >= 5, steady
        assert all(c >= 1 for c in fallback), fallback  # 12 KB > 4 KiB: the transport's call
        # Every exchange but the first found its receives posted during the one before (the
        # rows' length agreed a round ahead, as the capacity grows); each exchange posts the
        # next one's receives, but the shutdown's on a rank that asked for it (a rank that learns
        # of the shutdown from the rows has posted them: its close ends them).
        assert rows["posted"] == rows["exchanges"] - 1, rows
        assert rows["exchanges"] - 1 <= rows["posts"] <= rows["exchanges"], rows


def test_carry_off_reduces_through_the_transport():
    for bad, steady, carried, _, _ in _LAUNCH[2].results("carry_off"):
        assert not bad, bad
        assert carried == 0
        # each step: the grouped allreduce, the three ops, the per-tensor ones (fused by dtype)
        assert steady["exchange"] == 0 and steady["allreduce"] >= 5 * 5, steady
        assert steady["pack"] >= 5, steady  # (the spy sees the transport's packs)


def _calls_per_cached_step():
    import torch

    import horovod.torch as hvd
    from horovod.common.context import get_context

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    backend = get_context().engine.backend
    world = backend._world
    counts: dict[str, int] = {}
    order: list[str] = []

    class _Waited:  # a receive's work: when this rank waits for it
        def __init__(self, work):
            self.work = work

        def wait(self, *a):
            order.append("wait for a receive")
            return self.work.wait(*a)

    class _Counted:  # every call this rank makes on the world's Gloo process group
        def __getattr__(self, name):
            fn = getattr(world, name)

            def counted(*a, **k):
                counts[name] = counts.get(name, 0) + 1
                order.append(name)
                work = fn(*a, **k)
                return _Waited(work) if name == "recv" else work
            return counted

    ts = [torch.full((4,), float(r + i)) for i in range(161)]
    bad = []
    per_step = []
    orders = []
    for step in range(12):
        if step == 4:  # cached, the capacity agreed and the receives posted ahead
            backend._world = _Counted()
        counts.clear()
        order.clear()
        for i, t in enumerate(ts):
            t.fill_(float(r + i + step))
        hvd.grouped_allreduce_(ts, name="calls.grouped", op=hvd.Sum)
        for i, t in enumerate(ts):
            want = float(sum(k + i + step for k in range(n)))
            if not bool((t == want).all()):
                bad.append(f"rank {r} step {step} tensor {i}: {t.tolist()} != {want}")
        if step >= 4:
            per_step.append(dict(counts))
        if step >= 5:  # (the receives waited for were posted in a counted step)
            orders.append(list(order))
    backend._world = world
    hvd.shutdown()
    return bad, per_step, orders


def _spied() -> list[tuple[Any, str]]:
    """The methods and functions the bodies spy on or replace (put back after each)."""
    from horovod.common.backends import gloo as gloo_backend
    from horovod.common.engine import buffers

    return [(gloo_backend.GlooBackend, name) for name in ("allreduce", "allreduce_start", "exchange_rows",
                                                           "post_rows")] + [(buffers, "_pack")]


# Parts of the Gloo torch launches (horovodrun --gloo) at np=2 and np=3 that other modules share
# (tests/_shared_launch.py), each run from its own init under its own settings (read at init).
_LAUNCH = {n: joint_launch("torch", n, {
    "carried": under_settings(_cases, {"HOROVOD_GLOO_CARRY_BYTES": "4096"}, _spied),
    **({"carry_off": under_settings(_cases, {"HOROVOD_GLOO_CARRY_BYTES": "0"}, _spied)} if n == 2 else {}),
    "calls_per_step": under_settings(_calls_per_cached_step, {"HOROVOD_CYCLE_TIME": "60000"}, _spied),
}, timeout=480 if n == 2 else 240, gloo=True, late=True) for n in (2, 3)}


@pytest.mark.parametrize("np_", [2, 3])
def test_a_cached_tiny_grouped_step_is_one_exchange_of_sends_and_receives_posted_ahead(np_):
    # Every Gloo call of a cached grouped step of 161 tiny tensors: the row sent to each peer and
    # the next exchange's receives from each peer posted, before this rank waits for the rows;
    # nothing else (no collective, no second round). A long cycle time keeps the engine thread
    # from running idle rounds of its own.
    for bad, per_step, orders in _LAUNCH[np_].results("calls_per_step"):
        assert not bad, bad[:3]
        assert per_step == [{"send": np_ - 1, "recv": np_ - 1}] * 8, per_step
        # the next exchange's receives are posted before this rank waits for this one's rows
        peers = np_ - 1
        assert orders == [["send"] * peers + ["recv"] * peers + ["wait for a receive"] * peers] * 7, orders
