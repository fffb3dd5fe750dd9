"""The executor's piecewise allreduce, the output pool, the tunables and the host layout (one process).

A fake transport stands for ``n`` ranks that all hold the same data: its allreduce multiplies the
buffer by ``n`` (Sum) and records each call's size, so values and the call schedule are checked.
"""

from __future__ import annotations

import numpy as np
import pytest

from horovod.common.backends.base import Group
from horovod.common.engine.executor import Entry, Executor
from horovod.common.engine.hierarchy import host_layout
from horovod.common.engine.outputs import OutputPool
from horovod.common.engine.placement import HostPlacement
from horovod.common.engine.tunables import Tunables
from horovod.common.types import ReduceOp, Request, RequestType, Response


class FakeBackend:
    name = "mpi"

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls: list[int] = []

    def reduce_dtypes(self) -> frozenset[str]:
        return frozenset({"int32", "float32", "float64"})

    def allreduce(self, buf: np.ndarray, op: ReduceOp, group: Group, src: np.ndarray | None = None) -> None:
        assert buf.flags.c_contiguous and buf.ndim == 1
        if src is not None:
            np.copyto(buf, src)
        self.calls.append(buf.nbytes)
        buf *= self.n


def _run(shapes, dtype="float32", op=ReduceOp.AVERAGE, pre=1.0, post=1.0, in_place=True, n=2,
         chunk=1024, max_tensor=256, threshold=1 << 20, joined_at=None):
    backend = FakeBackend(n)
    tun = Tunables(fusion_threshold=threshold, max_tensor_bytes=max_tensor, chunk_bytes=chunk)
    ex = Executor(backend, {0: Group(list(range(n)), 0, None)}, 0, tun)
    batch, entries, inputs = [], [], []
    for i, shape in enumerate(shapes):
        req = Request(f"t{i}", RequestType.ALLREDUCE, dtype, (shape,), op, pre, post)
        batch.append(Response(req))
        x = (np.arange(int(np.prod(shape))) % 11 + 1).astype(dtype).reshape(shape)
        inputs.append(x.copy())
        entries.append(None if i == joined_at else Entry(req, [x], [x] if in_place else None, None))
    ex.run(batch, entries)
    return backend, entries, inputs


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("chunk", [0, 64, 1000, 4096])
def test_values_and_schedule_of_mixed_batches(in_place: bool, chunk: int) -> None:
    shapes = [(3,), (700,), (5, 7), (1,), (2000,), (64,), (10, 100)]
    backend, entries, inputs = _run(shapes, in_place=in_place, chunk=chunk)
    for e, x in zip(entries, inputs):
        np.testing.assert_array_equal(e.outputs[0], x)  # Average of identical ranks
        assert e.outputs[0].shape == x.shape and (e.outputs[0] is e.inputs[0]) == in_place
    total = sum(int(np.prod(s)) for s in shapes) * 4
    assert sum(backend.calls) == total
    if chunk:
        assert max(backend.calls) <= chunk, backend.calls
    # The schedule depends only on the shapes and settings, never on in-place or not.
    other, _, _ = _run(shapes, in_place=not in_place, chunk=chunk)
    assert other.calls == backend.calls


def test_large_tensors_are_cut_into_full_pieces_and_tails_are_packed() -> None:
    # 2000 floats = 8000 bytes, chunk 1024 bytes = 256 floats: 7 full pieces in place, a tail of
    # 208 floats (832 bytes) > max_tensor 256 bytes stays in place too; small ones are packed.
    backend, _, _ = _run([(2000,), (10,), (20,)], chunk=1024, max_tensor=256)
    assert backend.calls == [1024] * 7 + [832, 120]
    backend, _, _ = _run([(2000,), (10,), (20,)], chunk=1024, max_tensor=1000)
    assert backend.calls == [1024] * 7 + [832 + 120]  # tail packed with the small tensors


def test_sum_scale_factors_integers_float16_and_joined_zeros() -> None:
    shapes = [(300,), (5,), (1000,)]
    backend, entries, inputs = _run(shapes, op=ReduceOp.SUM, pre=2.0, post=0.25, n=3, chunk=512)
    for e, x in zip(entries, inputs):
        np.testing.assert_allclose(e.outputs[0], x * 2.0 * 3 * 0.25)
    _, entries, inputs = _run(shapes, dtype="int32", op=ReduceOp.SUM, n=3, chunk=512, in_place=False)
    for e, x in zip(entries, inputs):
        assert e.outputs[0].dtype == np.int32
        np.testing.assert_array_equal(e.outputs[0], x * 3)
    backend, entries, inputs = _run(shapes, dtype="float16", n=2, chunk=512, in_place=False)
    for e, x in zip(entries, inputs):
        assert e.outputs[0].dtype == np.float16
        np.testing.assert_array_equal(e.outputs[0], x)
    assert max(backend.calls) <= 512  # widened to float32 piece by piece
    # this rank joined for t1: its zeros are reduced (the fake doubles them: still zeros)
    backend, entries, inputs = _run(shapes, n=2, chunk=512, joined_at=1)
    assert entries[1] is None and sum(backend.calls) == sum(int(np.prod(s)) for s in shapes) * 4


def test_average_divides_by_size_exactly_at_np3() -> None:
    _, entries, inputs = _run([(5000,), (7,)], n=3, chunk=1024, in_place=False)
    for e, x in zip(entries, inputs):
        np.testing.assert_array_equal(e.outputs[0], (x * np.float32(3)) / np.float32(3))


def test_tunables_are_read_at_every_batch() -> None:
    backend = FakeBackend(2)
    tun = Tunables(chunk_bytes=400, max_tensor_bytes=0)
    ex = Executor(backend, {0: Group([0, 1], 0, None)}, 0, tun)
    req = Request("x", RequestType.ALLREDUCE, "float32", ((1000,),), ReduceOp.SUM)
    ex.run([Response(req)], [Entry(req, [np.ones(1000, np.float32)], None, None)])
    assert backend.calls == [400] * 10
    backend.calls.clear()
    ex.chunk_bytes = 2000
    assert tun.chunk_bytes == 2000 and ex.max_tensor_bytes == 0
    ex.run([Response(req)], [Entry(req, [np.ones(1000, np.float32)], None, None)])
    assert backend.calls == [2000, 2000]
    tun.update(fusion_threshold=0, cycle_time_ms=3.0)
    assert not ex.fusion_enabled and tun.as_dict()["cycle_time_ms"] == 3.0
    with pytest.raises(AttributeError, match="no field 'chunk'"):
        tun.update(chunk=1)


def test_output_pool_reuses_only_dropped_buffers() -> None:
    pool = OutputPool(min_bytes=1024)
    a = pool.empty((1000,), np.float32)
    addr = a.__array_interface__["data"][0]
    assert addr % 64 == 0
    b = pool.empty((1000,), np.float32)
    assert b.__array_interface__["data"][0] != addr
    del a
    c = pool.empty((250, 4), np.float32)
    assert c.__array_interface__["data"][0] == addr and c.shape == (250, 4)
    view = c[10:20]
    del c
    d = pool.empty((1000,), np.float32)
    assert d.__array_interface__["data"][0] != addr, "a buffer still viewed was handed out again"
    assert view.base is not None
    small = pool.empty((3,), np.float64)
    assert small.shape == (3,) and pool.tracked_bytes == 3 * 4000
    # Whatever wraps a result without copying keeps its buffer out of the pool.
    e = pool.empty((1000,), np.float32)
    e_addr = e.__array_interface__["data"][0]
    wrapped = memoryview(e.reshape(10, 100)[2:])
    del e
    f = pool.empty((1000,), np.float32)
    assert f.__array_interface__["data"][0] != e_addr
    del wrapped, f
    assert pool.empty((1000,), np.float32).__array_interface__["data"][0] == e_addr


def test_output_pool_forgets_dropped_buffers_of_other_sizes_when_full() -> None:
    """Results whose sizes change from call to call (an allgather of varying rows) do not keep
    the pool full: a new size beyond the budget evicts the dropped buffers, never one in use."""
    pool = OutputPool(min_bytes=1024, max_bytes=10_000)
    kept = pool.empty((1000,), np.float32)  # 4000 bytes, in use
    dropped = pool.empty((500,), np.float32)  # 2000 bytes
    del dropped
    assert pool.tracked_bytes == 6000
    new = pool.empty((1200,), np.float32)  # 4800: over the budget until the dropped one goes
    assert pool.tracked_bytes == 8800 and set(pool._by_size) == {4000, 4800}
    again = pool.empty((1000,), np.float32)  # the used one is never handed out again
    assert again.__array_interface__["data"][0] != kept.__array_interface__["data"][0]
    assert pool.tracked_bytes == 8800  # no room (both in use): allocated plainly, not tracked
    assert new.shape == (1200,) and again.shape == kept.shape == (1000,)


def test_large_outputs_start_on_a_huge_page(monkeypatch: pytest.MonkeyPatch) -> None:
    from horovod.common.engine import pages

    monkeypatch.setattr(pages, "_mode", "madvise")
    monkeypatch.setattr(pages, "_numpy_madvise", True)
    monkeypatch.setattr(pages, "_malloc_thp", False)
    pool = OutputPool(min_bytes=1024)
    for shape in ((1 << 19,), ((3 << 20) // 4 + 3,), (1000, 1000)):  # 2 MiB, 3 MiB + 12 B, 4 MB
        out = pool.empty(shape, np.float32)
        assert out.shape == shape and out.__array_interface__["data"][0] % (2 << 20) == 0
        assert pages.huge_page_backed(out.reshape(-1))
    small = pool.empty((1000,), np.float32)
    assert small.__array_interface__["data"][0] % 64 == 0


def test_host_layout() -> None:
    hosts = ["a", "a", "b", "b"]
    assert host_layout([0, 1, 2, 3], hosts) == ([0, 0, 1, 1], [0, 1, 0, 1])
    assert host_layout([0, 1, 2, 3], ["a", "b", "a", "b"]) == ([0, 1, 0, 1], [0, 0, 1, 1])
    assert host_layout([0, 2], hosts) is None  # one rank per host
    assert host_layout([0, 1], hosts) is None  # one host
    assert host_layout([0, 1, 2], hosts) is None  # uneven hosts


def test_overlap_setting_auto_and_explicit() -> None:
    from horovod.common.config import EngineConfig

    auto = EngineConfig.from_env({})
    assert Tunables.from_config(auto, local_size=2, cores=2).overlap is False
    assert Tunables.from_config(auto, local_size=2, cores=4).overlap is True
    on = EngineConfig.from_env({"HOROVOD_OVERLAP_GRADIENTS": "1", "HOROVOD_CHUNK_BYTES": "4096"})
    tun = Tunables.from_config(on, local_size=8, cores=1)
    assert tun.overlap is True and tun.chunk_bytes == 4096
    assert Tunables.from_config(EngineConfig.from_env({"HOROVOD_OVERLAP_GRADIENTS": "off"}), cores=64).overlap is False


@pytest.mark.parametrize("in_place", [True, False])
def test_schedule_does_not_depend_on_where_a_rank_reduces_large_tensors(
        in_place: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Reducing a large tensor's pieces in its own memory (huge pages) or through the fusion buffer
    # (4 KiB pages) is each rank's local choice: the transport calls must pair up either way.
    shapes = [(3,), (2000,), (5, 7), (700,), (1,), (1030,)]
    schedules = []
    for own in (True, False):
        monkeypatch.setattr(HostPlacement, "own_memory", staticmethod(lambda out, own=own: own))
        for max_tensor in (256, 1 << 20):
            backend, entries, inputs = _run(shapes, in_place=in_place, chunk=1024, max_tensor=max_tensor)
            for e, x in zip(entries, inputs):
                np.testing.assert_array_equal(e.outputs[0], x)
            schedules.append(backend.calls)
            if max_tensor > 8000:
                # 256 floats a piece. Whole pieces go alone (7 of t1, 2 of t3, 4 of t5); the small
                # tensors and the tails pack up until the next large tensor's pieces begin: [3],
                # [208 + 35], [188 + 1] and [6] floats.
                assert backend.calls == ([12] + [1024] * 7 + [243 * 4] + [1024] * 2 + [189 * 4]
                                         + [1024] * 4 + [24]), backend.calls
    assert all(s == schedules[1] for s in schedules[1::2]), schedules


def test_pages_know_numpy_and_registered_owners(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from horovod.common.engine import pages

    for text, mode in (("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                       ("always madvise [never]", "never")):
        (tmp_path / "enabled").write_text(text)
        monkeypatch.setattr(pages, "_mode", None)
        assert pages.thp_mode(str(tmp_path / "enabled")) == mode
    monkeypatch.setattr(pages, "_mode", None)
    assert pages.thp_mode(str(tmp_path / "missing")) == "never"

    monkeypatch.setattr(pages, "_mode", "madvise")
    monkeypatch.setattr(pages, "_numpy_madvise", True)
    big = np.ones(pages.NUMPY_HUGE_MIN_BYTES // 4, np.float32)
    assert pages.huge_page_backed(big) and pages.huge_page_backed(big[10:].reshape(-1))
    assert not pages.huge_page_backed(np.ones(1000, np.float32))
    foreign = np.frombuffer(bytearray(pages.NUMPY_HUGE_MIN_BYTES), np.float32)
    assert not pages.huge_page_backed(foreign)  # nobody vouches for a bytearray's pages

    class Owner:
        pass

    owner_buf = bytearray(64)
    monkeypatch.setattr(pages, "_owners", [])
    pages.register_owner(lambda o: True if isinstance(o, bytearray) and len(o) == 64 else None)
    assert pages.huge_page_backed(np.frombuffer(owner_buf, np.uint8))
    assert not pages.huge_page_backed(foreign)
    monkeypatch.setattr(pages, "_numpy_madvise", False)
    assert not pages.huge_page_backed(big)  # NumPy's madvise switched off
    monkeypatch.setattr(pages, "_mode", "always")
    assert pages.huge_page_backed(big) and pages.huge_page_backed(foreign)
    monkeypatch.setattr(pages, "_mode", "never")
    assert not pages.huge_page_backed(big) and not pages.huge_page_backed(np.frombuffer(owner_buf, np.uint8))


class SpanBackend(FakeBackend):
    """Records, for each transport call, whether it worked in ``flat``'s memory."""

    def __init__(self, n: int, flat: np.ndarray) -> None:
        super().__init__(n)
        self.flat = flat
        self.in_flat: list[bool] = []

    def allreduce(self, buf: np.ndarray, op: ReduceOp, group: Group, src: np.ndarray | None = None) -> None:
        self.in_flat.append(bool(np.shares_memory(buf, self.flat)))
        super().allreduce(buf, op, group, src)


def _run_views(views, flat, n=3, pre=1.0, post=1.0, in_place=True, chunk=1024):
    backend = SpanBackend(n, flat)
    tun = Tunables(fusion_threshold=1 << 20, max_tensor_bytes=1 << 20, chunk_bytes=chunk)
    ex = Executor(backend, {0: Group(list(range(n)), 0, None)}, 0, tun)
    reqs = [Request(f"t{i}", RequestType.ALLREDUCE, "float32", (v.shape,), ReduceOp.AVERAGE, pre, post)
            for i, v in enumerate(views)]
    entries = [Entry(r, [v], [v] if in_place else None, None) for r, v in zip(reqs, views)]
    ex.run([Response(r) for r in reqs], entries)
    return backend, entries


@pytest.mark.parametrize("pre,post", [(1.0, 1.0), (0.5, 3.0)])
def test_views_of_one_flat_buffer_are_reduced_where_they_lie(pre: float, post: float,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # A flattened gradient set: every tensor a view of one buffer, end to end. Each packed run
    # (small tensors and tails between two large tensors' pieces) is then one span of the buffer
    # and is reduced there, with exactly the transport calls of separately allocated tensors.
    shapes = [(3,), (2000,), (5, 7), (700,), (1,), (9, 3), (1030,), (4,)]
    sizes = [int(np.prod(s)) for s in shapes]
    monkeypatch.setattr(HostPlacement, "own_memory", staticmethod(lambda out: True))
    schedules = {}
    for layout in ("flat", "separate", "flat, one tensor elsewhere"):
        flat = (np.arange(sum(sizes)) % 13 + 1).astype(np.float32)
        want = flat * np.float32(pre) * 3 * np.float32(post) / 3
        views, o = [], 0
        for size, shape in zip(sizes, shapes):
            view = flat[o:o + size].reshape(shape)
            views.append(view.copy() if layout == "separate" else view)
            o += size
        if layout == "flat, one tensor elsewhere":
            views[4] = views[4].copy()  # breaks the run of t3's tail, t4 and t5
        backend, _ = _run_views(views, flat, pre=pre, post=post)
        got = np.concatenate([v.reshape(-1) for v in views])
        np.testing.assert_allclose(got, want, rtol=1e-6)
        schedules[layout] = backend.calls
        if layout == "flat":
            assert all(backend.in_flat), backend.in_flat  # no call went through the fusion buffer
        elif layout == "separate":
            assert not any(backend.in_flat), backend.in_flat
        else:
            assert backend.in_flat.count(False) == 1, backend.in_flat
    assert schedules["flat"] == schedules["separate"] == schedules["flat, one tensor elsewhere"], schedules


def test_flat_views_on_small_pages_or_out_of_place_are_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    for own, in_place in ((False, True), (True, False)):
        flat = np.ones(300, np.float32)
        views = [flat[:100], flat[100:300]]
        monkeypatch.setattr(HostPlacement, "own_memory", staticmethod(lambda out, own=own: own))
        backend, entries = _run_views(views, flat, n=2, in_place=in_place, chunk=4096)
        assert backend.in_flat == [False] and backend.calls == [1200]
        assert all(np.all(e.outputs[0] == 1) for e in entries)  # Average of 2 identical ranks
        assert np.all(flat == 1) or in_place


def test_jemalloc_with_thp_puts_every_large_block_on_huge_pages(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from horovod.common.engine import pages

    jemalloc, libc = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", ""
    for preload, conf, want in ((jemalloc, "thp:always,metadata_thp:auto", True), (jemalloc, "thp:default", False),
                                (libc, "thp:always", False), (jemalloc, "", False)):
        monkeypatch.setattr(pages, "_malloc_thp", None)
        assert pages.malloc_thp(preload, conf) is want, (preload, conf)
    for setting, release, want in (("0", "6.1.0", False), ("1", "3.10.0", True), ("", "6.1.0-13-amd64", True),
                                   ("", "4.5.7", False), ("", "4.6.0", True)):
        monkeypatch.setattr(pages, "_numpy_madvise", None)
        assert pages._numpy_madvises(setting, release) is want, (setting, release)
    monkeypatch.setattr(pages, "_mode", "madvise")
    monkeypatch.setattr(pages, "_numpy_madvise", True)
    mid = np.ones(pages.HUGE_PAGE_BYTES // 4 + 1, np.float32)  # 2 MiB: NumPy does not madvise it
    monkeypatch.setattr(pages, "_malloc_thp", False)
    assert not pages.huge_page_backed(mid)
    monkeypatch.setattr(pages, "_malloc_thp", True)
    assert pages.huge_page_backed(mid) and not pages.huge_page_backed(np.ones(1000, np.float32))
    monkeypatch.setattr(pages, "_mode", "never")
    assert not pages.huge_page_backed(mid)  # the kernel has the last word
