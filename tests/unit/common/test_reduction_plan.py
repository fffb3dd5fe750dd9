"""The planner (agreed sizes -> transport calls) and the executor that carries a plan out.

Every rank plans from the agreed sizes alone, so the test that every rank makes the same calls is
one test here: whatever a rank's memory (views of one flat buffer, separate tensors, out of place,
a joined rank's zeros, huge pages or not), the executor makes exactly the planned calls.
"""

from __future__ import annotations

import numpy as np
import pytest

from horovod.common.backends.base import Group
from horovod.common.engine.buffers import Item, Reduction, run_reduction
from horovod.common.engine.executor import Entry, Executor
from horovod.common.engine.host_buffers import NumpyBuffers
from horovod.common.engine.pages import huge_page_empty
from horovod.common.engine.placement import DevicePlacement, HostPlacement
from horovod.common.engine.plan import PACKED, PIECE, WHOLE, plan_reduction, post_factors
from horovod.common.engine.tunables import Tunables
from horovod.common.types import ReduceOp, Request, RequestType, Response

SHAPES = [(3,), (2000,), (5, 7), (700,), (0,), (1,), (9, 3), (1030,), (4,)]
LAYOUTS = ("flat", "separate", "out of place", "joined")


class Recorder:
    """A transport for ``n`` ranks holding the same data: Sum multiplies by ``n``."""

    name = "mpi"

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls: list[int] = []

    def reduce_dtypes(self) -> frozenset[str]:
        return frozenset({"float32", "float64", "int32"})

    def allreduce(self, buf: np.ndarray, op: ReduceOp, group: Group, src: np.ndarray | None = None) -> None:
        self.calls.append(buf.nbytes)
        buf *= self.n


def _check_cover(calls, sizes) -> None:
    seen = [np.zeros(n, int) for n in sizes]
    for call in calls:
        at = 0
        for i, s, e, off in call.segments:
            assert off == at and e > s
            seen[i][s:e] += 1
            at += e - s
        assert at == call.size
    assert all((s == 1).all() for s in seen)  # every element exactly once


@pytest.mark.parametrize("chunk,cut,fuse,widen", [(4096, 1 << 20, True, False), (4096, 2048, True, False),
                                                  (4096, 1 << 20, False, False), (4096, 1 << 20, True, True),
                                                  (0, 4096, True, False), (0, 4096, True, True),
                                                  (0, 4096, False, False)])
def test_plan_covers_every_element_once_in_bounded_calls(chunk: int, cut: int, fuse: bool, widen: bool) -> None:
    sizes = [int(np.prod(s)) for s in SHAPES]
    calls = plan_reduction(sizes, 4, chunk, cut, fuse, widen)
    _check_cover(calls, sizes)
    if chunk:
        assert all(c.size * 4 <= chunk for c in calls)
        assert all(c.kind in (PACKED, PIECE) for c in calls)
    else:  # unchunked: the large items one call each, the rest in one packed call
        large = [n for n in sizes if n and not widen and not (fuse and n * 4 <= cut)]
        assert [c.size for c in calls if c.kind == WHOLE] == large
        assert sum(c.kind == PACKED for c in calls) == (1 if sum(sizes) > sum(large) else 0)
    assert plan_reduction(sizes, 4, chunk, cut, fuse, widen) == calls  # pure


def test_post_factors() -> None:
    assert post_factors(ReduceOp.AVERAGE, 1.0, 3) == (1.0, 3)
    assert post_factors(ReduceOp.AVERAGE, 6.0, 3) == (2.0, 1)
    assert post_factors(ReduceOp.SUM, 0.5, 3) == (0.5, 1)


def _run(layout: str, dtype: str, own: bool, chunk: int, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(HostPlacement, "own_memory", staticmethod(lambda out: own))
    n = 3
    sizes = [int(np.prod(s)) for s in SHAPES]
    flat = (np.arange(sum(sizes)) % 7 + 1).astype(dtype)
    xs, o = [], 0
    for size, shape in zip(sizes, SHAPES):
        view = flat[o:o + size].reshape(shape)
        xs.append(view if layout == "flat" else view.copy())
        o += size
    backend = Recorder(n)
    tun = Tunables(fusion_threshold=1 << 20, max_tensor_bytes=1 << 20, chunk_bytes=chunk)
    ex = Executor(backend, {0: Group(list(range(n)), 0, None)}, 0, tun)
    req = Request("g", RequestType.ALLREDUCE, dtype, tuple(SHAPES), ReduceOp.AVERAGE, 1.0, 1.0,
                  flat=(layout == "flat"))
    outs = None if layout == "out of place" else xs
    entry = None if layout == "joined" else Entry(req, xs, outs, None)
    before = [x.copy() for x in xs]
    ex.run([Response(req)], [entry])
    if entry is not None:
        for b, got in zip(before, entry.outputs):
            np.testing.assert_array_equal(got, (b.astype(np.float64) * n / n).astype(dtype))
    return backend.calls


@pytest.mark.parametrize("chunk", [1024, 0])
def test_every_rank_makes_the_planned_calls_whatever_its_memory(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = [int(np.prod(s)) for s in SHAPES]
    for dtype, work in (("float32", 4), ("float16", 4), ("int32", 4)):
        planned = {}
        for flat in (True, False):
            if flat and chunk:  # a flat group is planned as one item of the group's size
                calls = plan_reduction([sum(sizes)], work, chunk, 1 << 20, True, dtype == "float16")
            else:
                calls = plan_reduction(sizes, work, chunk, 1 << 20, True, dtype == "float16")
            planned[flat] = [c.size * work for c in calls]
        for layout in LAYOUTS:
            for own in (True, False):
                got = _run(layout, dtype, own, chunk, monkeypatch)
                # the hint is kept only when every rank's memory is flat: here every rank is "flat"
                assert got == planned[layout == "flat"], (dtype, layout, own, got)


def test_a_new_kind_of_buffer_is_one_class() -> None:
    """The runner only talks to the buffer operations: a wrapper kind runs the same plan."""

    class Boxed:
        def __init__(self, a: np.ndarray) -> None:
            self.a = a

    class BoxedBuffers(NumpyBuffers):
        def piece(self, a, start, stop):
            return a.a[start:stop]

        def span(self, items, segs, inplace_only):
            return None  # never in place: everything through the buffer

        def pack(self, buf, items, segs, pre, widen):
            super().pack(buf, [Item(it.x.a, it.o.a, it.inplace, it.name, it.n) for it in items], segs, pre, widen)

        def unpack(self, buf, items, segs, post, div):
            super().unpack(buf, [Item(it.x.a, it.o.a, it.inplace, it.name, it.n) for it in items], segs, post, div)

    arrays = [np.arange(n, dtype=np.float32) for n in (5, 3000, 7)]
    items = [Item(Boxed(a), Boxed(a), True, "t", a.size) for a in arrays]
    calls = plan_reduction([a.size for a in arrays], 4, 1024, 1 << 20, True)
    seen: list[int] = []

    def reduce(buf: np.ndarray) -> None:
        seen.append(buf.size)
        buf *= 2

    want = [a * 2 / 2 for a in arrays]
    red = Reduction(ReduceOp.SUM, 1.0, 1.0, 2, np.dtype(np.float32), False, False)
    run_reduction(calls, items, BoxedBuffers(huge_page_empty), red, reduce, DevicePlacement())
    assert seen == [c.size for c in calls]
    for a, w in zip(arrays, want):
        np.testing.assert_array_equal(a, w)
