"""Property tests: every memo on the engine's hot path returns what a fresh computation returns,
and what it returns cannot be changed by a caller. PURE.

* ``Executor._plan_reduction`` (``plan.plan_reduction`` by all of its arguments);
* ``Executor._reduction`` (the widening and scaling rules, by dtype and transport);
* ``NumpyBuffers.items`` (a name's items, by the identity of its arrays), also after the caller's
  list was changed in place;
* ``batch_items`` through ``NumpyBuffers.recall`` (a memoized batch's items, by the identity of
  each entry's one in-place array), whatever each step hands over.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from horovod.common.backends.base import Group
from horovod.common.engine.buffers import batch_items
from horovod.common.engine.executor import Entry, Executor
from horovod.common.engine.host_buffers import NumpyBuffers
from horovod.common.engine.plan import plan_reduction
from horovod.common.engine.tunables import Tunables
from horovod.common.types import ReduceOp, Request, RequestType, Response

_SETTINGS = settings(max_examples=60, deadline=None)


class _Backend:
    name = "mpi"

    def reduce_dtypes(self) -> frozenset[str]:
        return frozenset({"uint8", "int8", "int32", "int64", "float32", "float64"})


def _executor() -> Executor:
    return Executor(_Backend(), {0: Group([0, 1, 2], 0, None)}, 0, Tunables())


_plan_args = st.tuples(st.lists(st.integers(0, 3000), max_size=12), st.sampled_from([1, 2, 4, 8]),
                       st.sampled_from([0, 64, 256, 4096]), st.sampled_from([0, 16, 512, 1 << 20]),
                       st.booleans(), st.booleans())


@_SETTINGS
@given(st.lists(_plan_args, min_size=1, max_size=8), st.randoms())
def test_plan_memo_hit_equals_a_fresh_plan(seq, rnd):
    ex = _executor()
    seq = seq + [rnd.choice(seq) for _ in range(len(seq))]  # repeats: memo hits
    for sizes, itemsize, chunk, cut, fuse, widen in seq:
        got = ex._plan_reduction(list(sizes), itemsize, chunk, cut, fuse, widen)
        assert got == plan_reduction(sizes, itemsize, chunk, cut, fuse, widen)
        assert isinstance(got, tuple) and all(isinstance(c.segments, tuple) for c in got)
        with pytest.raises((TypeError, AttributeError)):
            got.append(None)  # type: ignore[attr-defined]


class _Lane:
    """What ``Executor._reduction`` reads of a lane."""

    def __init__(self, native: frozenset[str]) -> None:
        self.ops = NumpyBuffers(lambda n: np.empty(n, np.uint8))
        self.transport = type("T", (), {"native": native, "name": "T"})()


_DTYPES = ["uint8", "int8", "int16", "uint16", "int32", "int64", "float16", "float32", "float64", "bool"]
_OPS = [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]


@_SETTINGS
@given(st.lists(st.tuples(st.sampled_from(_DTYPES), st.sampled_from(_OPS), st.sampled_from([1.0, 0.5, 3.0]),
                          st.sampled_from([1.0, 0.25, 7.0]), st.integers(1, 9),
                          st.sampled_from(["host", "gloo"])), min_size=1, max_size=20))
def test_reduction_memo_hit_equals_a_fresh_reduction(seq):
    ex = _executor()
    lanes = {"host": _Lane(frozenset(_Backend().reduce_dtypes())),
             "gloo": _Lane(frozenset({"uint8", "int8", "int32", "int64", "float16", "float32", "float64"}))}
    for dtype, op, pre, post, size, lane in seq + seq:
        req = Request(name="x", kind=RequestType.ALLREDUCE, dtype=dtype, shapes=((2,),), reduce_op=op,
                      prescale=pre, postscale=post)
        got = ex._reduction(req, size, lanes[lane])
        fresh = _executor()._reduction(req, size, lanes[lane])
        assert got == fresh


@_SETTINGS
@given(st.lists(st.tuples(st.sampled_from(["same", "copy", "replace", "append", "pop", "reshape"]),
                          st.integers(0, 30)), max_size=12))
def test_items_memo_hit_equals_fresh_items_after_list_changes(steps):
    ops = NumpyBuffers(lambda n: np.empty(n, np.uint8))
    arrays = [np.full((2, 3), k, np.float32) for k in range(NumpyBuffers.ITEMS_MEMO_MIN + 2)]
    for what, k in steps:
        if what == "copy":
            arrays = list(arrays)
        elif what == "replace":
            arrays[k % len(arrays)] = np.full((k % 4 + 1,), 100.0 + k, np.float32)
        elif what == "append":
            arrays.append(np.full((3,), -k, np.float32))
        elif what == "pop" and len(arrays) > 1:
            arrays.pop(k % len(arrays))
        elif what == "reshape":
            arrays[k % len(arrays)] = arrays[k % len(arrays)].reshape(-1)
        got = ops.items("g", arrays, arrays)
        fresh = NumpyBuffers(lambda n: np.empty(n, np.uint8)).items("g", arrays, arrays)
        assert len(got) == len(fresh) == len(arrays)
        for a, b, x in zip(got, fresh, arrays):
            assert (a.inplace, a.name, a.n) == (b.inplace, b.name, b.n)
            assert np.shares_memory(a.x, x) and a.x.shape == b.x.shape and np.array_equal(a.x, b.x)
            assert a.o is a.x


@_SETTINGS
@given(st.lists(st.tuples(st.sampled_from(["same", "replace", "new", "joined", "out_of_place", "other_batch"]),
                          st.integers(0, 30)), max_size=14))
def test_batch_items_memo_hit_equals_fresh_items(steps):
    n = NumpyBuffers.BATCH_MEMO_MIN + 3
    reqs = [Request(f"t{k}", RequestType.ALLREDUCE, "float32", ((2, 2),), ReduceOp.SUM) for k in range(n)]
    batches = [tuple(Response(r) for r in reqs), tuple(Response(r) for r in reqs)]
    ops = NumpyBuffers(lambda nbytes: np.empty(nbytes, np.uint8))
    arrays = [np.full((2, 2), k, np.float32) for k in range(n)]
    batch = batches[0]
    for what, k in steps + [("same", 0), ("same", 0)]:
        outs = None
        if what == "replace":
            arrays = list(arrays)
            arrays[k % n] = np.full((2, 2), 100.0 + k, np.float32)
        elif what == "new":
            arrays = [a.copy() for a in arrays]
        elif what == "out_of_place":
            outs = k % n
        elif what == "other_batch":
            batch = batches[k % 2]
        entries: list = []
        for j, (r, a) in enumerate(zip(reqs, arrays)):
            if what == "joined" and j == k % n:
                entries.append(None)
            elif outs == j:
                entries.append(Entry(r, [a], [np.full_like(a, -1.0)], None))  # not empty_like: NaN garbage != itself
            else:
                entries.append(Entry(r, [a], None, None))
                entries[-1].outputs = entries[-1].inputs
        got, starts = batch_items(batch, entries, ops)
        fresh, fresh_starts = batch_items(list(batch), entries, NumpyBuffers(lambda nb: np.empty(nb, np.uint8)))
        assert list(starts) == list(fresh_starts) and len(got) == len(fresh) == n
        for j, (a, b) in enumerate(zip(got, fresh)):
            assert (a.inplace, a.name, a.n) == (b.inplace, b.name, b.n)
            assert np.array_equal(a.x, b.x) and np.array_equal(a.o, b.o)
            e = entries[j]
            if e is not None:  # the very memory handed over this step
                assert np.shares_memory(a.x, e.inputs[0]) and np.shares_memory(a.o, e.outputs[0])
        if isinstance(got, tuple):  # remembered: a caller cannot change them
            assert all(e is not None and e.outputs is e.inputs for e in entries)
    # the same arrays twice in a row: the second time (and after) from the memo
    assert isinstance(got, tuple) and batch_items(batch, entries, ops)[0] is got
