"""Grouped in-place allreduces whose tensors lie end to end (``Request.flat``, one process).

The submitting rank says whether its tensors are views of one flat buffer; the coordinator keeps
the hint only when every rank's are, and then every rank reduces the group as one span, in pieces
cut from the span's start (the raw schedule of a flat buffer). A rank whose memory is not one
span (a later step's separate tensors, a joined rank's zeros) gathers each piece through the
buffer, so the transport calls are the same on every rank whatever memory each holds.
"""

from __future__ import annotations

import numpy as np
import pytest

from horovod.common.backends.base import Group
from horovod.common.engine.cache import ResponseCache
from horovod.common.engine.executor import Entry, Executor, end_to_end
from horovod.common.engine.negotiation import Coordinator
from horovod.common.engine.placement import HostPlacement
from horovod.common.engine.tunables import Tunables
from horovod.common.types import ReduceOp, Request, RequestType, Response

SHAPES = [(3,), (2000,), (5, 7), (700,), (1,), (9, 3), (1030,), (4,)]
LAYOUTS = ("flat", "separate", "flat, one tensor elsewhere", "joined")


class Recorder:
    """A transport for ``n`` ranks holding the same data: Sum multiplies by ``n``. Records each
    call's size and whether it worked in ``flat``'s memory."""

    name = "mpi"

    def __init__(self, n: int, flat: np.ndarray) -> None:
        self.n = n
        self.flat = flat
        self.calls: list[int] = []
        self.in_flat: list[bool] = []

    def reduce_dtypes(self) -> frozenset[str]:
        return frozenset({"float32", "float64"})

    def allreduce(self, buf: np.ndarray, op: ReduceOp, group: Group, src: np.ndarray | None = None) -> None:
        assert buf.flags.c_contiguous and buf.ndim == 1
        self.calls.append(buf.nbytes)
        self.in_flat.append(bool(np.shares_memory(buf, self.flat)))
        buf *= self.n


def _grouped(layout: str, hint: bool, dtype: str = "float32", chunk: int = 1024, pre: float = 1.0,
             post: float = 1.0, n: int = 3):
    sizes = [int(np.prod(s)) for s in SHAPES]
    flat = (np.arange(sum(sizes)) % 13 + 1).astype(dtype)
    want = (flat.astype(np.float64) * pre * post).astype(dtype)  # Average of n identical ranks
    views, o = [], 0
    for size, shape in zip(sizes, SHAPES):
        view = flat[o:o + size].reshape(shape)
        views.append(view.copy() if layout == "separate" else view)
        o += size
    if layout == "flat, one tensor elsewhere":
        views[2] = views[2].copy()
    backend = Recorder(n, flat)
    tun = Tunables(fusion_threshold=1 << 20, max_tensor_bytes=1 << 20, chunk_bytes=chunk)
    ex = Executor(backend, {0: Group(list(range(n)), 0, None)}, 0, tun)
    req = Request("grouped.g", RequestType.ALLREDUCE, dtype, tuple(SHAPES), ReduceOp.AVERAGE, pre, post,
                  flat=hint)
    entry = None if layout == "joined" else Entry(req, views, views, None)
    ex.run([Response(req)], [entry])
    got = None if entry is None else np.concatenate([v.reshape(-1) for v in views])
    return backend, got, want


@pytest.mark.parametrize("pre,post", [(1.0, 1.0), (0.5, 3.0)])
def test_a_flat_group_is_reduced_as_one_span_whatever_each_rank_holds(pre: float, post: float,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HostPlacement, "own_memory", staticmethod(lambda out: True))
    total = sum(int(np.prod(s)) for s in SHAPES) * 4
    schedules = {}
    for layout in LAYOUTS:
        backend, got, want = _grouped(layout, True, pre=pre, post=post)
        if got is not None:
            np.testing.assert_allclose(got, want, rtol=1e-6)
        schedules[layout] = backend.calls
        if layout == "flat":
            assert all(backend.in_flat), backend.in_flat  # reduced where it lies: no copies
    # The raw schedule of one flat buffer: whole 1 KiB pieces from the span's start, then the tail.
    assert schedules["flat"] == [1024] * (total // 1024) + [total % 1024], schedules["flat"]
    assert all(s == schedules["flat"] for s in schedules.values()), schedules
    # Without the hint the same group is cut at its large tensors: more, smaller calls.
    backend, got, want = _grouped("flat", False, pre=pre, post=post)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert sum(backend.calls) == total and len(backend.calls) > len(schedules["flat"])


def test_flat_groups_widened_unchunked_and_on_small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    # float16 is widened through the buffer, with the same pieces on every layout.
    monkeypatch.setattr(HostPlacement, "own_memory", staticmethod(lambda out: True))
    half = {layout: _grouped(layout, True, dtype="float16") for layout in LAYOUTS}
    for layout, (backend, got, want) in half.items():
        if got is not None:
            np.testing.assert_array_equal(got, want)
        assert backend.calls == half["flat"][0].calls and not any(backend.in_flat), layout
    # Unchunked (HOROVOD_CHUNK_BYTES=0) ignores the hint on every rank alike.
    for layout in ("flat", "separate"):
        backend, got, want = _grouped(layout, True, chunk=0)
        np.testing.assert_allclose(got, want)
        assert backend.calls == _grouped(layout, False, chunk=0)[0].calls
    # A span on small pages is copied through the buffer, piece by piece, with the same calls.
    monkeypatch.setattr(HostPlacement, "own_memory", staticmethod(lambda out: False))
    backend, got, want = _grouped("flat", True)
    np.testing.assert_allclose(got, want)
    assert backend.calls == _grouped("separate", True)[0].calls and not any(backend.in_flat)


def test_the_coordinator_keeps_the_hint_only_when_every_rank_has_it() -> None:
    def req(rank: int, flat: bool) -> Request:
        return Request("grouped.g", RequestType.ALLREDUCE, "float32", ((4,), (6,)), rank=rank, flat=flat)

    for flags, want in (((True, True, True), True), ((True, False, True), False), ((False, True, True), False)):
        c = Coordinator(3, {0: [0, 1, 2]}.get, lambda: 0.0)
        for rank, flag in enumerate(flags):
            c.submit([req(rank, flag)])
        (resp,) = c.ready()
        assert resp.error is None and resp.request.flat is want, flags
    # A hint is no argument: ranks that differ agree, and a cached name is reused whatever a
    # later step's hint says (a layout that changed is handled where the group is reduced).
    cache = ResponseCache(4)
    cache.put(Response(req(0, True)))
    assert cache.lookup(req(0, False)) == (0, True)


def test_end_to_end() -> None:
    buf = np.zeros(100, np.float32)
    assert end_to_end([buf[:10], buf[10:30].reshape(4, 5), buf[30:]])
    assert not end_to_end([buf[:10], buf[11:30]])  # a gap
    assert not end_to_end([buf[10:20], buf[:10]])  # out of order
    assert not end_to_end([buf[:10], buf[10:30:2]])  # not contiguous
    assert not end_to_end([buf[:10], np.zeros(5, np.float32)])
