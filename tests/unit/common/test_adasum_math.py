"""The pure Adasum module: the pairwise formula, and the VHDD schedule on simulated ranks (threads
exchanging through queues) against the NumPy oracle that pairs whole vectors in tree order."""

from __future__ import annotations

import queue
import threading
import types

import numpy as np
import pytest

from horovod.common.engine.adasum import (
    SQRT_DBL_MIN,
    adasum_pair,
    adasum_reference,
    is_power_of_two,
    pair_coefficients,
    vhdd_allreduce,
)


def _on_threads(size: int, body, errors: list[BaseException]) -> None:
    """Run ``body(rank)`` for every simulated rank on a thread of its own; fail with what they raised."""
    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors


def _simulate(per_rank: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
    """Run vhdd_allreduce on len(per_rank) threads; each rank's tensors are fused back to back."""
    size = len(per_rank)
    boxes = {(a, b): queue.Queue() for a in range(size) for b in range(size)}
    out: list[list[np.ndarray] | None] = [None] * size
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            tensors = per_rank[rank]
            buf = np.concatenate([t.reshape(-1) for t in tensors]) if tensors else np.zeros(0)

            def exchange(send: np.ndarray, recv: np.ndarray, peer: int) -> None:
                boxes[(rank, peer)].put(send.copy())
                got = boxes[(peer, rank)].get(timeout=10)
                assert got.size == recv.size, (rank, peer, got.size, recv.size)
                recv[...] = got

            vhdd_allreduce(buf, [t.size for t in tensors], rank, size, exchange)
            res, off = [], 0
            for t in tensors:
                res.append(buf[off:off + t.size].reshape(t.shape))
                off += t.size
            out[rank] = res
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    _on_threads(size, body, errors)
    return out  # type: ignore[return-value]


def test_pair_formula_orthogonal_adds_parallel_averages_zero_keeps():
    a, b = np.array([1.0, 0.0]), np.array([0.0, 3.0])
    np.testing.assert_array_equal(adasum_pair(a, b), a + b)
    np.testing.assert_allclose(adasum_pair(a, 3 * a), 2 * a)
    np.testing.assert_array_equal(adasum_pair(np.zeros(2), b), b)
    assert pair_coefficients(1.0, SQRT_DBL_MIN / 2, 4.0) == (1.0, 0.875)


def test_is_power_of_two():
    assert [n for n in range(1, 17) if is_power_of_two(n)] == [1, 2, 4, 8, 16]
    assert not is_power_of_two(0)


@pytest.mark.parametrize("size", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_vhdd_matches_tree_oracle_per_tensor(size, dtype):
    rng = np.random.default_rng(size)
    shapes = [(1,), (7,), (3, 5), (0,), (2,), (33,)]
    per_rank = [[rng.standard_normal(s).astype(dtype) for s in shapes] for _ in range(size)]
    results = _simulate(per_rank)
    tol = {"float16": 3e-3, "float32": 1e-6, "float64": 1e-13}[dtype]
    for i, s in enumerate(shapes):
        want = adasum_reference([per_rank[r][i] for r in range(size)])
        for r in range(size):
            got = results[r][i]
            assert got.dtype == np.dtype(dtype) and got.shape == s
            np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
        for r in range(1, size):  # every rank holds the same bits
            np.testing.assert_array_equal(results[r][i], results[0][i])


def test_fused_coefficients_are_per_tensor_not_per_buffer():
    # Tensor 0 is parallel across ranks (averages), tensor 1 orthogonal (adds): one fused buffer.
    per_rank = [[np.array([1.0, 2.0]) * (r + 1), np.eye(4)[r]] for r in range(4)]
    res = _simulate(per_rank)
    np.testing.assert_allclose(res[0][0], np.array([1.0, 2.0]) * 2.5)
    np.testing.assert_allclose(res[0][1], np.ones(4))


def test_float16_extremes_stay_finite():
    big = float(np.sqrt(np.finfo(np.float16).max))
    per_rank = [[np.full(64, big * (0.5 + r / 4), np.float16)] for r in range(4)]
    res = _simulate(per_rank)
    assert np.isfinite(res[0][0]).all()
    np.testing.assert_allclose(res[0][0].astype(np.float64), big * np.mean([0.5 + r / 4 for r in range(4)]),
                               rtol=2e-3)


def test_non_power_of_two_is_refused():
    with pytest.raises(ValueError, match="power-of-two"):
        vhdd_allreduce(np.ones(4), [4], 0, 3, lambda s, r, p: None)
    with pytest.raises(ValueError, match="power-of-two"):
        adasum_reference([np.ones(2)] * 3)


class _QueueTransport:
    """A host transport's Adasum side for one simulated rank: ``group`` and ``exchange``."""

    def __init__(self, rank: int, size: int, boxes: dict) -> None:
        from horovod.common.backends.base import Group

        self.group = Group(list(range(size)), rank, None)
        self._boxes = boxes

    def exchange(self, send: np.ndarray, recv: np.ndarray, peer: int) -> None:
        me = self.group.rank
        self._boxes[(me, peer)].put(send.copy())
        recv[...] = self._boxes[(peer, me)].get(timeout=10)


def _run_lane(per_rank: list[list[np.ndarray] | None], prescale: float, postscale: float,
              inplace: bool) -> list[list[np.ndarray]]:
    """``run_adasum`` on simulated ranks over the engine's own NumPy buffers; a rank whose list is
    None has joined (its entries are None, as the executor hands them over)."""
    from horovod.common.engine.adasum import run_adasum
    from horovod.common.engine.host_buffers import NumpyBuffers
    from horovod.common.engine.pages import huge_page_empty
    from horovod.common.engine.placement import HostPlacement
    from horovod.common.engine.transport import Lane
    from horovod.common.types import ReduceOp, Request, RequestType, Response

    size = len(per_rank)
    shapes = next(t for t in per_rank if t is not None)
    dtype = shapes[0].dtype.name
    batch = tuple(Response(Request(f"allreduce.t{i}", RequestType.ALLREDUCE, dtype, (tuple(t.shape),),
                                   ReduceOp.ADASUM, prescale, postscale)) for i, t in enumerate(shapes))
    boxes = {(a, b): queue.Queue() for a in range(size) for b in range(size)}
    out: list = [None] * size
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            lane = Lane(NumpyBuffers(huge_page_empty), _QueueTransport(rank, size, boxes),
                        HostPlacement(lambda: 64 << 20), 0, True)
            mine = per_rank[rank]
            entries = [None] * len(batch) if mine is None else [
                types.SimpleNamespace(inputs=[t.copy()], outputs=None) for t in mine]
            if inplace:
                for e in entries:
                    if e is not None:
                        e.outputs = e.inputs
            run_adasum(batch, entries, lane)
            out[rank] = None if mine is None else [e.outputs[0].reshape(t.shape) for e, t in zip(entries, mine)]
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    _on_threads(size, body, errors)
    return out  # type: ignore[return-value]


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("count", [1, 2, 4])
def test_lane_adasum_with_a_joined_rank_is_the_formula_with_its_zeros(dtype, inplace, count):
    """Rank 2 of 4 has joined: it takes part with zeros (the lane's ``zeros``), so every other rank
    gets the formula over the three vectors and a zero one, prescaled before and postscaled after
    (the lane's scaling); one tensor (reduced in its own memory) and fused batches alike."""
    rng = np.random.default_rng(count)
    shapes = [(5, 3), (1,), (1000,), (7,)][:count]
    per_rank: list = [[rng.standard_normal(s).astype(dtype) for s in shapes] for _ in range(4)]
    per_rank[2] = None
    pre, post = 0.5, 3.0
    got = _run_lane(per_rank, pre, post, inplace)
    tol = {"float16": 2e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
    for i, shape in enumerate(shapes):
        vecs = [(np.zeros(shape, dtype) if r is None else r[i]).astype(np.float64) * pre for r in per_rank]
        want = adasum_reference(vecs) * post
        for rank in (0, 1, 3):
            np.testing.assert_allclose(got[rank][i].astype(np.float64), want, rtol=tol, atol=tol)
            assert got[rank][i].dtype == np.dtype(dtype)
            np.testing.assert_array_equal(got[rank][i], got[0][i])  # the same bits on every rank
