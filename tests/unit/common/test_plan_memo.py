"""The memos of a cached step's plans, and the packing of many small tensors (issue 25).

* ``BatchRunner.plan`` memoizes ``fusion.plan_batches`` for rounds of cached responses, by ready
  slots and planning settings: it must return what a fresh plan would, also after a tunable
  changes, the cache is reset or a name is renegotiated with another shape;
* ``Executor._plan_reduction`` memoizes ``plan.plan_reduction`` on all of its arguments;
* ``NumpyBuffers.pack``/``unpack`` move many small segments with one concatenation / one scaling
  of the buffer: bit-identical to the per-segment copies;
* ``NumpyBuffers.items`` reuses a name's items only for the very same lists of arrays.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from horovod.common.backends.base import Group
from horovod.common.engine.buffers import Item
from horovod.common.engine.executor import Executor
from horovod.common.engine.host_buffers import NumpyBuffers, scale_array
from horovod.common.engine.plan import PACKED, plan_reduction
from horovod.common.engine.tunables import Tunables
from horovod.common.types import ReduceOp

_CODE = r"""
import numpy as np
from horovod.common import collectives as C
from horovod.common.context import get_context
from horovod.common.engine import runner
import horovod.numpy as hvd
hvd.init()
eng = get_context().engine
fresh_calls = []
real_plan_batches = runner.plan_batches
def counted(*a, **k):
    fresh_calls.append(1)
    return real_plan_batches(*a, **k)
runner.plan_batches = counted
checked = []
real_plan = eng.runner.plan
def checked_plan(responses, slots, joined):
    got = real_plan(responses, slots, joined)
    tun = eng.tunables
    want = real_plan_batches(responses, tun.fusion_threshold, tun.max_tensor_bytes,
                             not eng.config.disable_group_fusion)
    names = lambda bs: [[r.name for r in b] for b in bs]
    assert names(got) == names(want), (names(got), names(want))
    # the very response objects of this round (a stale memo would hold replaced ones)
    assert [r for b in got for r in b] == [r for b in want for r in b] or len(got) != len(want)
    for b, w in zip(got, want):
        assert all(x is y for x, y in zip(b, w)), "stale response objects in a memoized plan"
    checked.append(len(got))
    return got
eng.runner.plan = checked_plan

def step(shape=(4,), n=6):
    arrays = [np.ones(shape, np.float32) * (i + 1) for i in range(n)]
    hs = [C.allreduce_async([a], name=f"g{i}", inplace=True, wake=False) for i, a in enumerate(arrays)]
    for h in hs:
        h.wait()
    for i, a in enumerate(arrays):
        assert np.array_equal(a, np.ones(shape, np.float32) * (i + 1)), a

for _ in range(4):
    step()
before = len(fresh_calls)
for _ in range(4):
    step()
hits = 4 - (len(fresh_calls) - before)
print("hits", hits)
eng.tunables.fusion_threshold = 8          # a tunable that changes the plan: one batch per tensor
step(); step()
print("batches_after_threshold", checked[-1])
eng.tunables.fusion_threshold = 1 << 20
step()
print("batches_restored", checked[-1])
for slot in list(eng.cache.occupied()):    # the cache reset (autotune's cache toggle, elastic)
    eng.rounds.evict(slot)
print("memo_after_reset", len(eng.runner.memo.plans))
step(); step()
step(shape=(3, 2)); step(shape=(3, 2))     # renegotiated with new shapes: new responses
print("ok", len(checked))
hvd.shutdown()
"""


def test_engine_plan_memo_hits_and_never_returns_a_stale_plan():
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "HOROVOD_CYCLE_TIME": "1000"}
    out = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines() if " " in line)
    assert int(lines["hits"]) >= 1, out.stdout  # a repeated cached step plans from the memo
    assert lines["batches_after_threshold"] == "6", out.stdout
    assert lines["batches_restored"] == "1", out.stdout
    assert lines["memo_after_reset"] == "0", out.stdout
    assert "ok" in lines, out.stdout


@pytest.mark.parametrize("sizes,chunk,cut,fuse,widen", [
    ([4] * 161, 1 << 20, 1 << 20, True, False),
    ([3, 700, 35, 1, 2000, 64, 1000], 1024, 256, True, False),
    ([3, 700, 35, 1, 2000], 0, 256, True, True),
    ([5, 5, 5], 64, 256, False, False),
])
def test_plan_reduction_memo_is_the_plan_and_keyed_by_every_argument(sizes, chunk, cut, fuse, widen):
    ex = _executor()
    got = ex._plan_reduction(sizes, 4, chunk, cut, fuse, widen)
    assert got == plan_reduction(sizes, 4, chunk, cut, fuse, widen)
    assert ex._plan_reduction(list(sizes), 4, chunk, cut, fuse, widen) is got  # a hit
    # any other argument: another entry, equal to the fresh plan
    for args in [(sizes, 2, chunk, cut, fuse, widen), (sizes, 4, chunk // 2, cut, fuse, widen),
                 (sizes, 4, chunk, cut * 2, fuse, widen), (sizes, 4, chunk, cut, not fuse, widen),
                 (sizes, 4, chunk, cut, fuse, not widen), (sizes[:-1], 4, chunk, cut, fuse, widen)]:
        assert ex._plan_reduction(*args) == plan_reduction(*args)


class _Backend:
    name = "mpi"

    def reduce_dtypes(self) -> frozenset[str]:
        return frozenset({"int32", "float32", "float64"})


def _executor() -> Executor:
    return Executor(_Backend(), {0: Group([0, 1], 0, None)}, 0, Tunables())


# The reference: the per-segment path, one scale_array per segment (the code before the one-call path).
_slow_pack = NumpyBuffers.pack_each
_slow_unpack = NumpyBuffers.unpack_each


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32"])
@pytest.mark.parametrize("pre,post,div", [(1.0, 1.0, 1), (1.0, 1.0, 3), (0.3, 1.7, 1), (2.0, 0.5, 7)])
@pytest.mark.parametrize("inplace", [True, False])
def test_fast_pack_and_unpack_are_bit_identical_to_per_segment_copies(dtype, pre, post, div, inplace):
    rng = np.random.default_rng(0)
    shapes = [4] * 20 + [1, 300] + [4] * 5 + [7]
    work = np.dtype(dtype)
    # Segments as plan_reduction makes them: many small whole items and a tail of a large one.
    calls = [c for c in plan_reduction(shapes, work.itemsize, 256 * work.itemsize, 1 << 20, True)
             if c.kind == PACKED and len(c.segments) > 2]
    assert calls and any(s > 0 for c in calls for _i, s, _e, _b in c.segments)  # a partial segment
    base = [(rng.standard_normal(n) * 100).astype(dtype) for n in shapes]
    results = []
    for fast in (True, False):
        xs = [x.copy() for x in base]
        items = [Item(x, x if inplace else np.zeros_like(x), inplace, f"t{k}", x.size) for k, x in enumerate(xs)]
        ops = NumpyBuffers(lambda nbytes: np.empty(nbytes, np.uint8))
        outs = []
        for call in calls:
            buf = ops.buffer(work, call.size)
            if fast:
                ops.pack(buf, items, call.segments, pre, False)
            else:
                _slow_pack(buf, items, call.segments, pre, False)
            packed = buf.copy()
            buf *= 2 if work.kind != "f" else work.type(2)  # the "reduction"
            if fast:
                ops.unpack(buf, items, call.segments, post, div)
            else:
                _slow_unpack(buf, items, call.segments, post, div)
            outs.append(packed)
        outs.extend(it.o.copy() for it in items)
        results.append(outs)
    for a, b in zip(*results):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_widened_unpack_keeps_the_per_segment_path():
    # float16 reduced in float32: the buffer's dtype differs from the outputs' (no in-place scaling)
    xs = [np.full(4, 0.1 * (k + 1), np.float16) for k in range(8)]
    items = [Item(x, x, True, f"t{k}", 4) for k, x in enumerate(xs)]
    segs = tuple((k, 0, 4, 4 * k) for k in range(8))
    buf = np.arange(32, dtype=np.float32) / 3
    want = [np.empty(4, np.float16) for _ in xs]
    for k, w in enumerate(want):
        scale_array(w, buf[4 * k:4 * k + 4], 1.0, 3)
    NumpyBuffers(lambda n: np.empty(n, np.uint8)).unpack(buf.copy(), items, segs, 1.0, 3)
    for x, w in zip(xs, want):
        np.testing.assert_array_equal(x, w)


def test_reduction_values_with_many_small_tensors_and_scale_factors():
    from horovod.common.engine.executor import Entry
    from horovod.common.types import Request, RequestType, Response

    class Twice(_Backend):
        def allreduce(self, buf, op, group, src=None):
            buf *= 2

    ex = Executor(Twice(), {0: Group([0, 1], 0, None)}, 0, Tunables())
    batch, entries, xs = [], [], []
    for i in range(30):
        req = Request(f"t{i}", RequestType.ALLREDUCE, "float32", ((2, 2),), ReduceOp.AVERAGE, 0.5, 3.0)
        x = np.full((2, 2), i + 1, np.float32)
        xs.append(x.copy())
        batch.append(Response(req))
        entries.append(Entry(req, [x], [x], None))
    for _ in range(2):  # the second run plans from the memo
        ex.run(batch, entries)
        for e, x in zip(entries, xs):
            want = (x * np.float32(0.5) * 2) * np.float32(3.0 / 2)
            np.testing.assert_array_equal(e.outputs[0], want)
            x[...] = want
            e.outputs = [e.inputs[0]]


def test_items_are_reused_only_for_the_same_lists_of_a_name():
    ops = NumpyBuffers(lambda n: np.empty(n, np.uint8))
    arrays = [np.full((2, 2), k, np.float32) for k in range(NumpyBuffers.ITEMS_MEMO_MIN)]
    first = ops.items("g", arrays, arrays)
    assert [(it.x.shape, it.inplace, it.name, it.n) for it in first] == [((4,), True, "g", 4)] * len(arrays)
    assert all(np.shares_memory(it.x, a) for it, a in zip(first, arrays))
    assert ops.items("g", arrays, arrays) is first  # the same arrays: the same items
    assert isinstance(first, tuple)  # remembered items cannot be changed by a caller
    copy = list(arrays)  # the same arrays in another list: the same items
    assert ops.items("g", copy, copy) is first
    # the caller's list changed in place (one array replaced): built afresh, from the new array
    copy[3] = np.full((2, 2), 99, np.float32)
    again = ops.items("g", copy, copy)
    assert again is not first and np.shares_memory(again[3].x, copy[3]) and float(again[3].x[0]) == 99
    assert all(np.shares_memory(it.x, a) for it, a in zip(again, copy))
    outs = [np.empty_like(a) for a in arrays]  # another output list: not in place
    fresh = ops.items("g", copy, outs)
    assert not any(it.inplace for it in fresh) and all(it.o.base is o for it, o in zip(fresh, outs))
    assert ops.items("g", copy, outs) is not fresh  # out of place: never remembered
    assert ops._items["g"].items is not fresh
    few = arrays[:2]  # small entries are not remembered
    assert ops.items("s", few, few) is not ops.items("s", few, few)
    for k in range(NumpyBuffers.ITEMS_MEMO_SIZE):  # bounded: a full memo starts over
        ops.items(f"n{k}", arrays, arrays)
    assert len(ops._items) <= NumpyBuffers.ITEMS_MEMO_SIZE


def test_remembered_views_move_the_same_values_and_follow_a_new_fusion_buffer():
    # A repeated grouped operation: the same items each step, the same (memoized) segments. Its
    # views are made once; values must equal the per-segment path's, also for partial segments
    # and after the fusion buffer was replaced by a larger one.
    shapes = [4] * 20 + [1, 300] + [4] * 5 + [7]
    work = np.dtype("float32")
    calls = [c for c in plan_reduction(shapes, work.itemsize, 256 * work.itemsize, 1 << 20, True)
             if c.kind == PACKED and len(c.segments) > 2]
    assert any(s > 0 for c in calls for _i, s, _e, _b in c.segments)  # a partial segment
    ops = NumpyBuffers(lambda nbytes: np.empty(nbytes, np.uint8))
    arrays = [np.zeros(n, work) for n in shapes]
    items = ops.items("g", arrays, arrays)
    rng = np.random.default_rng(1)
    for step in range(4):
        if step == 2:  # a larger buffer replaces the one the views were made of
            ops.buffer(work, 1 << 16)
            assert not ops._items["g"].moves
        for a in arrays:
            a[...] = rng.standard_normal(a.size)
        want = [a.copy() for a in arrays]
        ref_items = [Item(w, w, True, "ref", w.size) for w in want]
        for call in calls:
            buf = ops.buffer(work, call.size)
            ops.pack(buf, items, call.segments, 0.5, False)
            ref = np.empty_like(buf)
            _slow_pack(ref, ref_items, call.segments, 0.5, False)
            np.testing.assert_array_equal(buf, ref)
            buf *= 3
            ref *= 3
            ops.unpack(buf, items, call.segments, 1.0, 2)
            _slow_unpack(ref, ref_items, call.segments, 1.0, 2)
        for a, w in zip(arrays, want):
            np.testing.assert_array_equal(a, w)
        assert len(ops._items["g"].moves) == len(calls)  # made once per set of segments


def test_a_batch_memo_holds_no_array_until_the_same_arrays_come_again():
    # A binding that hands over new arrays every step (tensor.numpy() of new gradients) must not
    # have its last step's arrays kept alive by the memo; the same arrays twice are remembered.
    import gc
    import weakref

    from horovod.common.engine.buffers import batch_items
    from horovod.common.engine.executor import Entry
    from horovod.common.types import Request, RequestType, Response

    n = NumpyBuffers.BATCH_MEMO_MIN
    reqs = [Request(f"t{k}", RequestType.ALLREDUCE, "float32", ((3,),), ReduceOp.SUM) for k in range(n)]
    batch = tuple(Response(r) for r in reqs)
    ops = NumpyBuffers(lambda nbytes: np.empty(nbytes, np.uint8))

    def entries(arrays):
        out = [Entry(r, [a], None, None) for r, a in zip(reqs, arrays)]
        for e in out:
            e.outputs = e.inputs
        return out

    fresh = [np.ones(3, np.float32) for _ in range(n)]
    ref = weakref.ref(fresh[0])
    first, _ = batch_items(batch, entries(fresh), ops)
    del fresh, first
    gc.collect()
    assert ref() is None  # only identities were noted
    kept = [np.ones(3, np.float32) for _ in range(n)]
    a, _ = batch_items(batch, entries(kept), ops)
    b, _ = batch_items(batch, entries(kept), ops)
    c, _ = batch_items(batch, entries(kept), ops)
    assert not isinstance(a, tuple) and isinstance(b, tuple) and c is b
    assert all(it.x is x for it, x in zip(c, kept))
    other = list(kept)
    other[2] = np.zeros(3, np.float32)
    d, _ = batch_items(batch, entries(other), ops)  # one array replaced: built afresh
    assert d is not b and d[2].x is other[2]
    assert batch_items(list(batch), entries(kept), ops)[0] is not b  # a batch made this round
