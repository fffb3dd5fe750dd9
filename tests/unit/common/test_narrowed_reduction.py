"""A compression's narrowing in the fusion buffer (``Reduction.narrow``): float32 arrays under a
16-bit request give the values of their 16-bit copies reduced as 16-bit tensors.

One process, a transport that multiplies by ``n`` (``n`` ranks holding the same data), in the
16-bit dtype itself (MPI's and Gloo's 16-bit reductions) or, lacking it, widened to float32 (the
local backend's bfloat16); pipelined (Gloo's calls in flight) or one call at a time (MPI); narrowed
arrays alone and mixed with native 16-bit ones in one batch; in and out of place; every scaling.
The reference is the same executor run on ``x.astype(wire)``, widened afterwards.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest

from horovod.common.backends import half
from horovod.common.backends.base import Group
from horovod.common.engine.executor import Entry, Executor
from horovod.common.engine.host_buffers import NumpyBuffers
from horovod.common.engine.tunables import Tunables
from horovod.common.types import ReduceOp, Request, RequestType, Response

pytestmark = pytest.mark.unit

BF16 = np.dtype(ml_dtypes.bfloat16)
# a large tensor cut into pieces with its tail packed, small ones packed side by side
SIZES = [3, 2000, 35, 700, 1, 27, 1030, 4, 1200]


class Transport:
    """``n`` ranks holding the same data: Sum multiplies by ``n`` (in the buffer's dtype, float32
    arithmetic rounded once for 16-bit buffers, as the planes' 16-bit reductions do)."""

    name = "fake"
    pins_pages = False

    def __init__(self, n: int, native: frozenset[str], pipeline: int) -> None:
        self.n, self._native, self.pipeline = n, native, pipeline
        self.handed: list[str] = []
        if pipeline < 2:
            self.allreduce_start = None  # type: ignore[assignment]

    def reduce_dtypes(self) -> frozenset[str]:
        return self._native

    def _times_n(self, buf: np.ndarray) -> None:
        self.handed.append(buf.dtype.name)
        if buf.dtype.char in half.HALF_CHARS:
            half.scale(buf, buf, float(self.n))
        else:
            np.multiply(buf, self.n, out=buf)

    def allreduce(self, buf: np.ndarray, op: ReduceOp, group: Group, src: np.ndarray | None = None) -> None:
        self._times_n(buf)

    def allreduce_start(self, buf: np.ndarray, op: ReduceOp, group: Group) -> Callable[[], None]:
        return lambda: self._times_n(buf)


def _run(arrays: list[np.ndarray], wire: np.dtype, native: frozenset[str], pipeline: int, op: ReduceOp,
         pre: float, post: float, inplace: bool, n: int = 3) -> tuple[list[np.ndarray], Transport]:
    backend = Transport(n, native, pipeline)
    tun = Tunables(fusion_threshold=1 << 20, max_tensor_bytes=1 << 20, chunk_bytes=1024)
    ex = Executor(backend, {0: Group(list(range(n)), 0, None)}, 0, tun)  # type: ignore[arg-type]
    batch, entries = [], []
    for i, a in enumerate(arrays):
        req = Request(f"t{i}", RequestType.ALLREDUCE, wire.name, (a.shape,), op, pre, post)
        batch.append(Response(req))
        entries.append(Entry(req, [a], [a] if inplace else None, None))  # type: ignore[arg-type]
    ex.run(batch, entries)
    return [e.outputs[0] for e in entries], backend


@pytest.mark.parametrize("wire", [np.dtype(np.float16), BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "widened"])
@pytest.mark.parametrize("pipeline", [1, 2], ids=["one-call", "pipelined"])
@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "out"])
@pytest.mark.parametrize("op,pre,post", [(ReduceOp.AVERAGE, 1.0, 1.0), (ReduceOp.SUM, 1.0, 1.0),
                                         (ReduceOp.SUM, 0.5, 3.0), (ReduceOp.AVERAGE, 1.0, 0.25)])
def test_narrowed_arrays_reduce_as_their_16_bit_copies(wire, native, pipeline, inplace, op, pre, post):
    rng = np.random.default_rng(5)
    wide = [(rng.standard_normal(k) * 40).astype(np.float32) for k in SIZES]
    # every other array a native 16-bit one: narrowed and native items share fused calls
    mixed = [w if i % 2 == 0 else w.astype(wire) for i, w in enumerate(wide)]
    dtypes = frozenset({"float32", "float64"} | ({wire.name} if native else set()))
    want, ref_backend = _run([m.astype(wire) for m in mixed], wire, dtypes, pipeline, op, pre, post, inplace)
    given = [m.copy() for m in mixed]
    got, backend = _run(given, wire, dtypes, pipeline, op, pre, post, inplace)
    for i, (g, w, m) in enumerate(zip(got, want, mixed)):
        assert g.dtype == m.dtype, i
        assert np.array_equal(g.astype(np.float64), w.astype(np.float64)), (i, g[:4], w[:4])
        if inplace:
            assert g is given[i]
    assert backend.handed == ref_backend.handed  # the same transport calls, in the same dtype
    assert set(backend.handed) == {wire.name if native else "float32"}


def test_narrowed_calls_never_reduce_in_the_arrays_memory(monkeypatch):
    seen = []
    real = NumpyBuffers.pack_narrowed
    monkeypatch.setattr(NumpyBuffers, "pack_narrowed", lambda *a: seen.append(1) or real(*a))
    wide = [np.full(5000, 1.25, np.float32)]  # alone: a native tensor this size is reduced in place
    got, backend = _run(wide, np.dtype(np.float16), frozenset({"float16", "float32"}), 1, ReduceOp.SUM,
                        1.0, 1.0, True)
    assert seen and np.array_equal(got[0], np.full(5000, 3.75, np.float32))


def _scaled(a16: np.ndarray, factor: float, divisor: int) -> np.ndarray:
    """The reference: float32 arithmetic in NumPy, rounded once to the 16-bit dtype."""
    wide = a16.astype(np.float32)
    wide = wide / np.float32(divisor) if divisor != 1 else wide * np.float32(factor)
    with np.errstate(all="ignore"):
        return wide.astype(a16.dtype)


@pytest.mark.parametrize("wire", [np.dtype(np.float16), BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("with_torch", [True, False, "one-thread"])
@pytest.mark.parametrize("factor,divisor", [(1.0, 1), (1.0, 2), (1.0, 3), (1.0, 8), (0.3, 1)])
def test_cast_rounds_once_and_scales_in_the_16_bit_type(wire, with_torch, factor, divisor, monkeypatch):
    """With torch in torch's grain-sized pieces (several here), with torch on one thread (in
    ``half.SOLO_PIECE`` pieces: one here), and with NumPy: the same bits."""
    if not with_torch:
        monkeypatch.setitem(sys.modules, "torch", None)
    elif with_torch == "one-thread":
        monkeypatch.setattr(half, "piece", lambda _torch: half.SOLO_PIECE)
    else:
        monkeypatch.setattr(half, "piece", lambda _torch: half.TORCH_PIECE)
    x = (np.random.default_rng(1).standard_normal(70_001) * 1e3).astype(np.float32)
    x[:50] *= np.float32(1e-9)  # 16-bit subnormals
    x16 = x.astype(wire)
    want = _scaled(x16, factor, divisor)
    narrow = np.empty(x.size, wire)
    half.cast(narrow, x, factor, divisor)
    assert np.array_equal(narrow.view(np.uint16), want.view(np.uint16))
    scaled = np.empty(x.size, wire)
    half.scale(scaled, x16, factor, divisor)
    assert np.array_equal(scaled.view(np.uint16), want.view(np.uint16))
    back = np.empty(x.size, np.float32)
    src = x16.copy()
    half.cast(back, src, factor, divisor)  # (scales ``src`` in place on the way)
    assert np.array_equal(back, want.astype(np.float32))


@pytest.mark.parametrize("divisor", [2, 4, 8])
@pytest.mark.parametrize("size", [4099, half.SOLO_PIECE])
def test_bfloat16_widening_by_a_power_of_two_scales_in_float32(divisor, size, monkeypatch):
    """Widening bfloat16 with a power-of-two divisor (Average at np=2, 4, 8) scales after the
    widening, in float32: the 16-bit scaling's values everywhere bfloat16 is normal, and, below
    2**-126 (bfloat16's subnormals), the exact product that bfloat16 would have rounded."""
    import torch  # noqa: F401  (the torch path)

    monkeypatch.setattr(half, "piece", lambda _torch: size)
    rng = np.random.default_rng(3)
    x16 = (rng.standard_normal(70_001) * 1e3).astype(np.float32).astype(BF16)
    tiny = np.float32(2.0 ** -126) * np.arange(1, 201, dtype=np.float32)  # halves are subnormal
    x16[:200] = (tiny * np.float32(1.0078125)).astype(BF16)
    back = np.empty(x16.size, np.float32)
    half.cast(back, x16.copy(), 1.0, divisor)
    want = x16.astype(np.float32) * np.float32(1.0 / divisor)
    assert np.array_equal(back, want)
    normal = np.abs(want) >= np.float32(2.0 ** -126)
    assert np.array_equal(back[normal], _scaled(x16, 1.0, divisor).astype(np.float32)[normal])
