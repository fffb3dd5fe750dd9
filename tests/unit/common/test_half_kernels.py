"""The 16-bit float reduction kernels (horovod/common/backends/half.py): every implementation gives
the same bits as float32 arithmetic rounded once, over random bit patterns (NaN, infinities,
subnormals included), for every op and odd counts; and the 16-bit scaling."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from horovod.common.backends import half
from horovod.common.types import ReduceOp

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
OPS = [(ReduceOp.SUM, np.add), (ReduceOp.PRODUCT, np.multiply), (ReduceOp.MIN, np.minimum),
       (ReduceOp.MAX, np.maximum)]


def _reference(dtype: str, uf, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """op(a, b) computed in float32 and rounded once to ``dtype`` (as uint16 bits)."""
    dt = np.dtype(np.float16) if dtype == "float16" else BF16
    with np.errstate(all="ignore"):
        out = uf(a.view(dt).astype(np.float32), b.view(dt).astype(np.float32)).astype(dt)
    return out.view(np.uint16)


def _same(x: np.ndarray, y: np.ndarray, dtype: str) -> bool:
    dt = np.dtype(np.float16) if dtype == "float16" else BF16
    nan = np.isnan(x.view(dt).astype(np.float32)) & np.isnan(y.view(dt).astype(np.float32))
    return bool(np.all((x == y) | nan))


def _implementations(dtype: str, op: ReduceOp, monkeypatch) -> dict:
    impls = {"numpy": half.numpy_kernel(dtype, op)}
    torch = pytest.importorskip("torch")
    impls["torch"] = half._torch_kernel(torch, dtype, op)
    if dtype == "bfloat16":  # the bit-level path of a process without ml_dtypes
        with monkeypatch.context() as m:
            m.setattr(half, "ml_bfloat16", lambda: None)
            impls["bits"] = half.numpy_kernel(dtype, op)
    return impls


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("op,uf", OPS, ids=lambda v: getattr(v, "name", ""))
@pytest.mark.parametrize("count", [1, 7, 20_001])
def test_every_kernel_rounds_float32_arithmetic_once(dtype, op, uf, count, monkeypatch):
    rng = np.random.default_rng(count)
    a = rng.integers(0, 1 << 16, count, dtype=np.uint32).astype(np.uint16)
    b = rng.integers(0, 1 << 16, count, dtype=np.uint32).astype(np.uint16)
    want = _reference(dtype, uf, a, b)
    for label, run in _implementations(dtype, op, monkeypatch).items():
        got = b.copy()
        run(a.copy(), got)  # writable buffers, as MPI hands them
        assert _same(got, want, dtype), f"{label} {dtype} {op.name}: {np.nonzero(got != want)[0][:5]}"


def test_the_dispatching_kernel_takes_memoryviews_and_empty_buffers():
    run = half.kernel("float16", ReduceOp.SUM)
    a = np.array([1.5, -2.0, 65504.0], np.float16)
    b = np.array([0.25, 2.0, 65504.0], np.float16)
    run(memoryview(a.view(np.uint8)), memoryview(b.view(np.uint8)))
    assert b.tolist() == [1.75, 0.0, np.inf]
    run(memoryview(a[:0].view(np.uint8)), memoryview(b[:0].view(np.uint8)))


def test_unknown_dtype_or_op_is_refused():
    with pytest.raises(TypeError, match="float32"):
        half.kernel("float32", ReduceOp.SUM)
    with pytest.raises(TypeError, match="ADASUM"):
        half.kernel("float16", ReduceOp.ADASUM)


def test_bf16_narrow_rounds_to_nearest_even_and_keeps_nan():
    x = np.array([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -8 + 2 ** -20, np.nan, np.inf, 3.4e38,
                  -0.0], np.float32)
    out = np.empty(x.size, np.uint16)
    half.bf16_narrow(x.copy(), out, np.empty(x.size, np.uint32))
    want = x.astype(BF16).view(np.uint16)
    assert _same(out, want, "bfloat16")
    assert np.isnan(out.view(BF16).astype(np.float32)[3])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("with_torch", [True, False])
def test_scale_is_float32_math_rounded_once(dtype, with_torch, monkeypatch):
    if with_torch:
        pytest.importorskip("torch")
    else:  # a process without torch: NumPy's float32 loops
        monkeypatch.setitem(sys.modules, "torch", None)
    dt = np.dtype(np.float16) if dtype == "float16" else BF16
    src = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dt)
    for factor, div in ((1.0, 3), (0.1, 1), (1.0, 7)):
        got = np.empty_like(src)
        with np.errstate(all="ignore"):
            half.scale(got, src, factor, div)
        with np.errstate(all="ignore"):
            wide = src.astype(np.float32)
            want = (wide / np.float32(div) if div != 1 else wide * np.float32(factor)).astype(dt)
        assert _same(got.view(np.uint16), want.view(np.uint16), dtype)


def test_the_piece_size_follows_torchs_threads_on_the_calling_thread():
    class OneThread:
        @staticmethod
        def get_num_threads() -> int:
            return 1

    class TwoThreads:
        @staticmethod
        def get_num_threads() -> int:
            return 2

    assert half.piece(OneThread) == half.SOLO_PIECE
    assert half.piece(TwoThreads) == half.TORCH_PIECE
    assert half.SOLO_PIECE > half.TORCH_PIECE


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("op,uf", OPS, ids=lambda v: getattr(v, "name", ""))
@pytest.mark.parametrize("size", [4099, half.TORCH_PIECE, half.SOLO_PIECE])
def test_the_torch_kernel_gives_the_same_bits_in_any_piece_size(dtype, op, uf, size, monkeypatch):
    """Pieces of any size (an odd one that leaves a short tail, torch's grain, the one-thread size)
    reduce every element once: the bits of float32 arithmetic rounded once."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(half, "piece", lambda _torch: size)
    rng = np.random.default_rng(size)
    n = 2 * size + 5  # several whole pieces and a tail
    a = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    b = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    got = b.copy()
    half._torch_kernel(torch, dtype, op)(a.copy(), got)
    want = _reference(dtype, uf, a, b)
    assert _same(got, want, dtype), np.nonzero(got != want)[0][:5]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("op,uf", OPS, ids=lambda v: getattr(v, "name", ""))
def test_gloos_two_member_reduction_is_its_float32_accumulation_rounded_once(dtype, op, uf):
    """Gloo's large 16-bit allreduce reduces the parts a member receives locally: for two members
    in one pass in the 16-bit type (``_reduce_half_pair``), the same bits as the float32
    accumulation of any member count (``_reduce_half_parts``), in both rows (sent to both)."""
    torch = pytest.importorskip("torch")
    from horovod.common.backends import gloo

    tdtype = torch.float16 if dtype == "float16" else torch.bfloat16
    n = 2 * half.TORCH_PIECE + 5
    rng = np.random.default_rng(n)
    bits = rng.integers(0, 1 << 16, (2, n), dtype=np.uint32).astype(np.uint16)
    pair = torch.from_numpy(bits.view(np.int16).copy()).view(tdtype)
    parts = torch.from_numpy(bits.view(np.int16).copy()).view(tdtype)
    gloo._reduce_half_pair(torch, pair, op)
    gloo._reduce_half_parts(torch, parts, op)
    got = pair.view(torch.int16).numpy().view(np.uint16)
    acc = parts.view(torch.int16).numpy().view(np.uint16)
    want = _reference(dtype, uf, bits[1], bits[0])
    for row in range(2):
        assert _same(got[row], want, dtype), f"pair row {row}: {np.nonzero(got[row] != want)[0][:5]}"
        assert _same(acc[row], want, dtype), f"parts row {row}: {np.nonzero(acc[row] != want)[0][:5]}"
    three = torch.from_numpy(rng.integers(0, 1 << 16, (3, 1000), dtype=np.uint32).astype(np.int16)).view(tdtype)
    gloo._reduce_half_parts(torch, three, op)
    rows = three.view(torch.int16).numpy()
    assert np.array_equal(rows[0], rows[1]) and np.array_equal(rows[0], rows[2])
