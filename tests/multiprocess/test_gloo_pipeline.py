"""The Gloo data plane's pipelined reductions on real ranks (``horovodrun --gloo``, np=2 and np=3).

Small pieces (``HOROVOD_CHUNK_BYTES=4096``) cut every large tensor into many calls, with tails and
small tensors packed across piece boundaries; the Gloo plane's own large pieces (no
``HOROVOD_CHUNK_BYTES``) reduce tensors around 1 MiB and one piece in four dtypes, copying only
the small ones; each rank contributes different values, and every
rank checks every element against the exact sum. The same run with ``HOROVOD_GLOO_PIPELINE=0``
reduces one call at a time. A spy on the backend counts the calls started asynchronously and the
most in flight at once; another counts fusion-buffer packs (none for views of one flat tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch, under_settings

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]


def _cases():
    import numpy as np
    import torch

    import horovod.torch as hvd
    from horovod.common.backends import gloo as gloo_backend
    from horovod.common.engine import host_buffers

    seen = {"started": 0, "flight": 0, "most": 0, "sync": 0, "packs": 0}
    start, sync, pack = (gloo_backend.GlooBackend.allreduce_start, gloo_backend.GlooBackend.allreduce,
                         host_buffers.NumpyBuffers.pack)

    def spy_start(self, buf, op, group):
        wait = start(self, buf, op, group)
        seen["started"] += 1
        seen["flight"] += 1
        seen["most"] = max(seen["most"], seen["flight"])

        def spied_wait():
            seen["flight"] -= 1
            wait()
        return spied_wait

    def spy_sync(self, buf, op, group, src=None):
        seen["sync"] += buf.size > 64  # the controller's and barriers' small ones aside
        return sync(self, buf, op, group, src)

    def spy_pack(self, *a, **k):
        seen["packs"] += 1
        return pack(self, *a, **k)
    gloo_backend.GlooBackend.allreduce_start = spy_start
    gloo_backend.GlooBackend.allreduce = spy_sync
    host_buffers.NumpyBuffers.pack = spy_pack

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad: list[str] = []
    shapes = [(3,), (5000,), (7, 11), (2500,), (1,), (9, 3), (1030,), (4,), (600, 2)] + [(300,)] * 9

    def contribution(k: int, shape: tuple[int, ...], i: int, dtype: torch.dtype) -> torch.Tensor:
        numel = int(np.prod(shape))
        return ((torch.arange(numel, dtype=torch.float64) % 17) * (k + 1) + i).to(dtype).reshape(shape)

    def expect(shape: tuple[int, ...], i: int, dtype: torch.dtype) -> torch.Tensor:
        return sum(contribution(k, shape, i, torch.float64) for k in range(n)).to(dtype)

    def check(label: str, got: list[torch.Tensor], dtype: torch.dtype, average: bool = False) -> None:
        for i, (g, s) in enumerate(zip(got, shapes)):
            want = expect(s, i, dtype)
            if average:
                want = want / n
            if not torch.equal(g, want):
                at = int((g.reshape(-1) != want.reshape(-1)).nonzero()[0, 0])
                bad.append(f"rank {r} {label} tensor {i} {tuple(s)}: element {at} is "
                           f"{g.reshape(-1)[at].item()}, the sum over {n} ranks is {want.reshape(-1)[at].item()}")

    for dtype in (torch.float32, torch.float64):
        # separate tensors, grouped and one by one, Sum in place
        ts = [contribution(r, s, i, dtype) for i, s in enumerate(shapes)]
        hvd.grouped_allreduce_(ts, name=f"grouped.{dtype}", op=hvd.Sum)
        check(f"grouped {dtype}", ts, dtype)
        ts = [contribution(r, s, i, dtype) for i, s in enumerate(shapes)]
        handles = [hvd.allreduce_async_(t, name=f"async.{dtype}.{i}", op=hvd.Sum) for i, t in enumerate(ts)]
        for h in handles:
            hvd.synchronize(h)
        check(f"async {dtype}", ts, dtype)
        # out of place, Average
        ts = [contribution(r, s, i, dtype) for i, s in enumerate(shapes)]
        outs = hvd.grouped_allreduce(ts, name=f"oop.{dtype}", op=hvd.Average)
        check(f"out of place {dtype}", outs, dtype, average=True)

    # views of one flat buffer per dtype (DDP's gradient_as_bucket_view), both dtypes at once
    packs_before = seen["packs"]
    flats, views = {}, {}
    for dtype in (torch.float32, torch.float64):
        flats[dtype] = torch.cat([contribution(r, s, i, dtype).reshape(-1) for i, s in enumerate(shapes)])
        vs, o = [], 0
        for s in shapes:
            k = int(np.prod(s))
            vs.append(flats[dtype][o:o + k].view(s))
            o += k
        views[dtype] = vs
    handles = [hvd.grouped_allreduce_async_(views[d], name=f"flat.{d}", op=hvd.Sum) for d in views]
    for h in handles:
        hvd.synchronize(h)
    for d in views:
        check(f"flat views {d}", views[d], d)
    flat_packs = seen["packs"] - packs_before
    hvd.shutdown()
    return bad, seen, flat_packs


def _default_pieces():
    """The Gloo plane's own piece sizes (no ``HOROVOD_CHUNK_BYTES``): pieces of P = 16 MiB,
    tensors of A = 1 MiB and more as calls of their own. Tensors around both sizes (one of
    P + 1.2 A whose tail is a call of its own, one of P + 0.4 A whose tail is packed, 1.5 A and A
    reduced where they lie, 0.9 A and small ones packed between them) in float32, float64, float16
    and int32; separate, grouped, out of place (Average) and views of one flat buffer per dtype."""
    import numpy as np
    import torch

    import horovod.torch as hvd
    from horovod.common.backends import gloo as gloo_backend
    from horovod.common.context import get_context
    from horovod.common.engine import host_buffers

    packed: list[int] = []  # bytes of every packed segment (a copy into a fusion buffer)
    pack = host_buffers.NumpyBuffers.pack

    def spy_pack(self, buf, items, segs, pre, widen):
        packed.extend((e - s) * items[i].x.itemsize for i, s, e, _ in segs)
        return pack(self, buf, items, segs, pre, widen)
    host_buffers.NumpyBuffers.pack = spy_pack

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    tun = get_context().engine.tunables
    pieces = (tun.chunk_bytes, tun.alone_bytes)
    assert pieces == gloo_backend.GlooBackend.piece_sizes, pieces
    bad: list[str] = []
    P, A = pieces

    def shapes_for(item: int) -> list[tuple[int, ...]]:
        # in bytes of the dtype: P + 1.2 A, small, 1.5 A, P + 0.4 A, small, A exactly, 0.9 A
        return [(3,), (int(P + 1.2 * A) // item,), (7, 11), (int(1.5 * A) // item // 4, 4), (5,),
                (int(P + 0.4 * A) // item,), (1,), (A // item,), (int(0.9 * A) // item,), (300,)]

    import functools

    @functools.cache
    def base(numel):
        return torch.arange(numel, dtype=torch.float64) % 17

    def contribution(k, shape, i, dtype):
        return (base(int(np.prod(shape))) * (k + 1) + i).to(dtype).reshape(shape)

    @functools.cache
    def expected(s, i, dtype, average):
        want = base(int(np.prod(s))) * (n * (n + 1) // 2) + n * i  # the sum over ranks, exact
        return (want / n if average else want).to(dtype).reshape(s)

    def check(label, got, shapes, dtype, average=False):
        for i, (g, s) in enumerate(zip(got, shapes)):
            want = expected(s, i, dtype, average)
            if not torch.equal(g, want):
                at = int((g.reshape(-1) != want.reshape(-1)).nonzero()[0, 0])
                bad.append(f"rank {r} {label} tensor {i} {tuple(s)}: element {at} is "
                           f"{g.reshape(-1)[at].item()}, expected {want.reshape(-1)[at].item()}")

    for dtype in (torch.float32, torch.float64, torch.float16, torch.int32):
        item = torch.tensor([], dtype=dtype).element_size()
        shapes = shapes_for(item)
        ts = [contribution(r, s, i, dtype) for i, s in enumerate(shapes)]
        hvd.grouped_allreduce_(ts, name=f"big.grouped.{dtype}", op=hvd.Sum)
        check(f"grouped {dtype}", ts, shapes, dtype)
        ts = [contribution(r, s, i, dtype) for i, s in enumerate(shapes)]
        handles = [hvd.allreduce_async_(t, name=f"big.async.{dtype}.{i}", op=hvd.Sum) for i, t in enumerate(ts)]
        for h in handles:
            hvd.synchronize(h)
        check(f"async {dtype}", ts, shapes, dtype)
        if dtype in (torch.float32, torch.float64):
            ts = [contribution(r, s, i, dtype) for i, s in enumerate(shapes)]
            outs = hvd.grouped_allreduce(ts, name=f"big.oop.{dtype}", op=hvd.Average)
            check(f"out of place average {dtype}", outs, shapes, dtype, average=True)
    most = max(packed)
    # views of one flat buffer per dtype, float32 and float64 at once: no copy at all
    before = len(packed)
    views = {}
    for dtype in (torch.float32, torch.float64):
        shapes = shapes_for(torch.tensor([], dtype=dtype).element_size())
        flat = torch.cat([contribution(r, s, i, dtype).reshape(-1) for i, s in enumerate(shapes)])
        vs, o = [], 0
        for s in shapes:
            k = int(np.prod(s))
            vs.append(flat[o:o + k].view(s))
            o += k
        views[dtype] = (vs, shapes)
    handles = [hvd.grouped_allreduce_async_(views[d][0], name=f"big.flat.{d}", op=hvd.Average) for d in views]
    for h in handles:
        hvd.synchronize(h)
    for d, (vs, shapes) in views.items():
        check(f"flat views {d}", vs, shapes, d, average=True)
    flat_packs = len(packed) - before
    hvd.shutdown()
    return bad, pieces, most, flat_packs


def _spied() -> list[tuple[Any, str]]:
    """The methods the bodies spy on (put back after each)."""
    from horovod.common.backends import gloo as gloo_backend
    from horovod.common.engine import host_buffers

    return [(gloo_backend.GlooBackend, "allreduce_start"), (gloo_backend.GlooBackend, "allreduce"),
            (host_buffers.NumpyBuffers, "pack")]


def _settings(fn: Callable[[], Any], env: Mapping[str, str | None]) -> Callable[[], Any]:
    return under_settings(fn, env, _spied)


# Parts of the Gloo torch launches (horovodrun --gloo) at np=2 and np=3 that other modules share
# (tests/_shared_launch.py), each run from its own init under its own settings (read at init):
# the Gloo plane's own pieces, small pieces pipelined, and (np=2) small pieces one call at a time.
_CHUNKS = {"HOROVOD_CHUNK_BYTES": "4096"}
_LAUNCH = {n: joint_launch("torch", n, {
    "default_pieces": _settings(_default_pieces, {"HOROVOD_CHUNK_BYTES": None}),
    "pipelined": _settings(_cases, _CHUNKS),
    **({"pipeline_off": _settings(_cases, {**_CHUNKS, "HOROVOD_GLOO_PIPELINE": "0"})} if n == 2 else {}),
}, timeout=540 if n == 2 else 300, gloo=True, late=True) for n in (2, 3)}


@pytest.mark.parametrize("np_", [2, 3])
def test_default_large_pieces_reduce_exactly_and_copy_only_small_tensors(np_):
    for bad, pieces, most, flat_packs in _LAUNCH[np_].results("default_pieces"):
        assert not bad, bad
        assert pieces == (16 << 20, 1 << 20)
        # only tensors (and tails) below 1 MiB went through a fusion buffer
        assert 0 < most < pieces[1], most
        assert flat_packs == 0, f"views of one flat buffer were packed {flat_packs} times"


@pytest.mark.parametrize("np_", [2, 3])
def test_pipelined_reductions_sum_exactly(np_):
    for bad, seen, flat_packs in _LAUNCH[np_].results("pipelined"):
        assert not bad, bad
        assert seen["started"] > 50 and seen["most"] == 2 and seen["flight"] == 0, seen
        assert flat_packs == 0, f"views of one flat buffer were packed {flat_packs} times"


def test_pipeline_off_reduces_one_call_at_a_time():
    for bad, seen, _ in _LAUNCH[2].results("pipeline_off"):
        assert not bad, bad
        assert seen["started"] == 0 and seen["sync"] > 50, seen


@pytest.mark.parametrize("symbol", [None, 0, 1])
def test_shm_allreduce_detection_reads_the_library(tmp_path, monkeypatch, symbol):
    """Found exactly when torch's library carries one of Gloo's shm allreduce symbols."""
    import torch

    from horovod.common.backends import gloo as gloo_backend

    (tmp_path / "lib").mkdir()
    body = b"\0_ZN4gloo9allreduceERKNS_6detail20AllreduceOptionsImplE\0"
    if symbol is not None:
        body += gloo_backend.SHM_ALLREDUCE_SYMBOLS[symbol] + b"\0"
    (tmp_path / "lib" / "libtorch_cpu.so").write_bytes(body * 100)
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "__init__.py"))
    monkeypatch.setattr(gloo_backend, "_shm_found", [])
    found = gloo_backend.shm_allreduce()
    if symbol is None:
        assert found is None
    else:
        assert found is not None and "libtorch_cpu.so" in found
        assert gloo_backend.SHM_ALLREDUCE_SYMBOLS[symbol].decode() in found


def test_the_installed_torch_is_reported_as_measured(monkeypatch):
    """torch 2.13's wheel carries Gloo without the shm allreduce (docs/performance.md)."""
    import torch

    from horovod.common.backends import gloo as gloo_backend

    monkeypatch.setattr(gloo_backend, "_shm_found", [])
    found = gloo_backend.shm_allreduce()
    if torch.__version__.startswith("2.13."):
        assert found is None, found
