"""Pipelined reductions (``buffers.run_pipelined``): several transport calls of a batch in flight.

One process, a transport that reduces lazily: ``allreduce_start`` only notes the buffer and a copy
of what it held, and the reduction happens at the wait, which first checks that nobody wrote into
the buffer while it was "in flight" (a fusion buffer packed again too early would fail it). The
results must be those of the one-at-a-time path, for tensors spanning piece boundaries, in and
out of place, views of one flat buffer and separate tensors, every scaling.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from horovod.common.backends.base import Group
from horovod.common.engine.executor import Entry, Executor
from horovod.common.engine.host_buffers import NumpyBuffers
from horovod.common.engine.tunables import Tunables
from horovod.common.types import ReduceOp, Request, RequestType, Response

pytestmark = pytest.mark.unit

# large tensors cut into pieces with their tails packed, then small ones filling packed calls one
# after the other (consecutive fusion buffers in flight)
SHAPES = [(3,), (2000,), (5, 7), (700,), (1,), (9, 3), (1030,), (4,), (600, 2)] + [(100,)] * 12


class LazyTransport:
    """``n`` ranks holding the same data (Sum multiplies by ``n``), reduced at the wait."""

    name = "gloo"
    pins_pages = False

    def __init__(self, n: int, pipeline: int, fail_at: int = -1) -> None:
        self.n = n
        self.pipeline = pipeline
        self.fail_at = fail_at
        self.started = 0
        self.sync_calls = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self.waited = 0

    def reduce_dtypes(self) -> frozenset[str]:
        return frozenset({"float32", "float64"})

    def allreduce(self, buf: np.ndarray, op: ReduceOp, group: Group, src: np.ndarray | None = None) -> None:
        self.sync_calls += 1
        buf *= self.n

    def allreduce_start(self, buf: np.ndarray, op: ReduceOp, group: Group) -> Callable[[], None]:
        assert op == ReduceOp.SUM
        held = buf.copy()
        k = self.started
        self.started += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)

        def wait() -> None:
            self.in_flight -= 1
            self.waited += 1
            if k == self.fail_at:
                raise RuntimeError(f"call {k} failed")
            assert np.array_equal(buf, held), f"call {k}'s buffer was written while in flight"
            np.multiply(buf, self.n, out=buf)
        return wait


def _run(layout: str, pipeline: int, op: ReduceOp = ReduceOp.AVERAGE, pre: float = 1.0, post: float = 1.0,
         inplace: bool = True, dtype: str = "float32", n: int = 3, fail_at: int = -1):
    sizes = [int(np.prod(s)) for s in SHAPES]
    flat = ((np.arange(sum(sizes)) % 13) + 1).astype(dtype)
    views, o = [], 0
    for size, shape in zip(sizes, SHAPES):
        view = flat[o:o + size].reshape(shape)
        views.append(view.copy() if layout == "separate" else view)
        o += size
    backend = LazyTransport(n, pipeline, fail_at)
    tun = Tunables(fusion_threshold=1 << 20, max_tensor_bytes=1 << 20, chunk_bytes=1024)
    ex = Executor(backend, {0: Group(list(range(n)), 0, None)}, 0, tun)  # type: ignore[arg-type]
    req = Request("grouped.g", RequestType.ALLREDUCE, dtype, tuple(SHAPES), op, pre, post,
                  flat=layout == "flat" and inplace)
    entry = Entry(req, views, views if inplace else None, None)  # type: ignore[arg-type]
    ex.run([Response(req)], [entry])
    outs = entry.outputs if entry.outputs is not None else views
    return backend, np.concatenate([np.asarray(v).reshape(-1) for v in outs])


@pytest.mark.parametrize("layout", ["flat", "separate"])
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("op,pre,post", [(ReduceOp.AVERAGE, 1.0, 1.0), (ReduceOp.SUM, 1.0, 1.0),
                                         (ReduceOp.SUM, 0.5, 3.0), (ReduceOp.AVERAGE, 1.0, 0.25)])
def test_pipelined_results_equal_the_one_at_a_time_path(layout, inplace, op, pre, post):
    lazy, got = _run(layout, 2, op, pre, post, inplace)
    one, want = _run(layout, 0, op, pre, post, inplace)
    assert lazy.started > 4 and lazy.sync_calls == 0, "the batch was not pipelined"
    assert one.started == 0 and one.sync_calls == lazy.started, "the same calls, one at a time"
    assert lazy.most_in_flight == 2 and lazy.waited == lazy.started
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("depth", [3, 5])
def test_deeper_pipelines_keep_their_buffers_until_waited(depth, dtype):
    lazy, got = _run("separate", depth, dtype=dtype)
    _, want = _run("separate", 0, dtype=dtype)
    assert lazy.most_in_flight == depth
    np.testing.assert_array_equal(got, want)


def test_views_of_one_flat_buffer_are_reduced_without_copies(monkeypatch):
    packs: list[int] = []
    orig = NumpyBuffers.pack

    def spy(self, buf, items, segs, pre, widen):
        packs.append(len(segs))
        return orig(self, buf, items, segs, pre, widen)
    monkeypatch.setattr(NumpyBuffers, "pack", spy)
    lazy, got = _run("flat", 2)
    assert not packs, f"views of one flat buffer were packed ({packs})"
    assert lazy.started == -(-sum(int(np.prod(s)) for s in SHAPES) * 4 // 1024)  # whole pieces of the span
    _run("separate", 2)
    assert packs, "separate tensors need packing (the spy sees nothing)"


def test_a_failed_wait_leaves_nothing_in_flight():
    views = [np.ones(s, np.float32) for s in SHAPES]
    backend = LazyTransport(3, 3, fail_at=1)
    tun = Tunables(fusion_threshold=1 << 20, max_tensor_bytes=1 << 20, chunk_bytes=1024)
    ex = Executor(backend, {0: Group([0, 1, 2], 0, None)}, 0, tun)  # type: ignore[arg-type]
    req = Request("g", RequestType.ALLREDUCE, "float32", tuple(SHAPES), ReduceOp.SUM, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="call 1 failed"):
        ex.run([Response(req)], [Entry(req, views, views, None)])  # type: ignore[arg-type]
    assert backend.in_flight == 0 and backend.waited == backend.started >= 3
