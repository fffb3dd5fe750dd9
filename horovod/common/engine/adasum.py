"""Adasum: adaptive summation of gradients by recursive vector halving / distance doubling. PURE.

Upstream Horovod's CPU Adasum (``horovod/common/ops/adasum/adasum.h``), re-built on NumPy. Two
vectors ``a`` and ``b`` combine as::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient stays 1 when its vector's squared norm is below ``sqrt(DBL_MIN)``): orthogonal
vectors add, parallel ones average. Over ``2^k`` ranks the pairs form a binary tree in rank order
(``((r0 r1) (r2 r3)) ...``), computed with vector halving, distance doubling (VHDD):

- level ``d = 1, 2, 4, ...``: each rank exchanges half of its current region with rank ``r ^ d``
  (the rank whose bit ``d`` is clear keeps the first half), so after the level each rank owns a
  slice of the combined vector of its ``2d``-rank block. Dot products and squared norms are taken
  in float64 **per tensor** on each slice and summed over the ``2d`` ranks of the block, so the
  coefficients are those of the whole tensors even though every rank holds only a slice;
- then the slices are exchanged back in reverse order (an allgather), leaving the result on every
  rank.

Element math follows upstream: float64 and float32 are combined in float64 (float32 rounded once),
float16 in float32 with float32 coefficients. Sizes must be powers of two (the bindings check it,
as upstream does, with ``NotImplementedError``).

The transport is a single primitive, ``exchange(send, recv, peer)``: send ``send`` to group member
``peer`` and receive ``recv`` from it (a sendrecv). ``adasum_reference`` is the NumPy oracle that
applies the pairwise formula in the same tree order on whole vectors. ``run_adasum`` runs one of
the executor's batches on the host ``Lane``: everything but the schedule (items, a joined rank's
zeros, the fusion buffer, the scaling) is the lane's, as for every other reduction.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from horovod.common.engine.buffers import batch_items
from horovod.common.engine.plan import post_factors
from horovod.common.types import Response

__all__ = ["SQRT_DBL_MIN", "is_power_of_two", "pair_coefficients", "combine",
           "adasum_pair", "adasum_reference", "vhdd_allreduce", "Exchange", "run_adasum"]

SQRT_DBL_MIN = math.sqrt(np.finfo(np.float64).tiny)

Exchange = Callable[[np.ndarray, np.ndarray, int], None]


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def pair_coefficients(dot: float, anormsq: float, bnormsq: float) -> tuple[float, float]:
    """(coefficient of a, coefficient of b) of one Adasum pair, from float64 dot and norms."""
    acoeff = 1.0 - dot / anormsq * 0.5 if anormsq >= SQRT_DBL_MIN else 1.0
    bcoeff = 1.0 - dot / bnormsq * 0.5 if bnormsq >= SQRT_DBL_MIN else 1.0
    return acoeff, bcoeff


# Elements per piece of the float64 work on float16/float32 data: the widened copies stay in cache
# instead of streaming whole-tensor temporaries through memory.
_PIECE = 65536


def _dot_norms(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """(a.b, |a|^2, |b|^2) accumulated in float64.

    einsum, not np.dot: BLAS dot products start a thread pool that spins on a busy machine
    (measured: 55-80 ms instead of 2-3 ms for 128 Ki elements with the 2 cores oversubscribed).
    """
    dot = an = bn = 0.0
    for i in range(0, a.size, _PIECE):
        x, y = a[i:i + _PIECE], b[i:i + _PIECE]
        if x.dtype != np.float64:
            x = x.astype(np.float64)
            y = y.astype(np.float64)
        dot += float(np.einsum("i,i->", x, y))
        an += float(np.einsum("i,i->", x, x))
        bn += float(np.einsum("i,i->", y, y))
    return dot, an, bn


def combine(a: np.ndarray, b: np.ndarray, acoeff: float, bcoeff: float) -> None:
    """``a <- acoeff * a + bcoeff * b`` in place, in upstream's precision for ``a``'s dtype."""
    if a.dtype == np.float64:
        a *= acoeff
        b_scaled = b * bcoeff
        a += b_scaled
        return
    work, ca, cb = (np.float32, np.float32(acoeff), np.float32(bcoeff)) if a.dtype == np.float16 else \
        (np.float64, acoeff, bcoeff)
    for i in range(0, a.size, _PIECE):
        x = a[i:i + _PIECE]
        t: np.ndarray = x.astype(work)
        t *= ca
        u: np.ndarray = b[i:i + _PIECE].astype(work)
        u *= cb
        t += u
        np.copyto(x, t, casting="unsafe")


def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The Adasum combination of two whole vectors (a new array of ``a``'s dtype)."""
    dot, an, bn = _dot_norms(a.reshape(-1), b.reshape(-1))
    out = a.reshape(-1).copy()
    combine(out, b.reshape(-1), *pair_coefficients(dot, an, bn))
    return out.reshape(a.shape)


def adasum_reference(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """Oracle: Adasum of one tensor's per-rank values, pairing neighbours level by level."""
    n = len(vectors)
    if not is_power_of_two(n):
        raise ValueError(f"Adasum needs a power-of-two number of vectors, got {n}")
    level = [np.array(v, copy=True) for v in vectors]
    while len(level) > 1:
        level = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def _slices(offsets: Sequence[int], lo: int, hi: int) -> list[tuple[int, int]]:
    """Per tensor, the part of [lo, hi) inside it, as (start, stop) (empty parts as (x, x))."""
    out = []
    for i in range(len(offsets) - 1):
        s, e = max(offsets[i], lo), min(offsets[i + 1], hi)
        out.append((s, max(s, e)))
    return out


def _block_sum(values: np.ndarray, rank: int, width: int, exchange: Exchange) -> np.ndarray:
    """Sum a float64 array over the ``width`` ranks of this rank's aligned block (recursive doubling).

    Every step adds the partner's array to this one's (IEEE addition commutes), so every rank of
    the block ends with bit-identical sums and the coefficients agree everywhere.
    """
    recv = np.empty_like(values)
    d = 1
    while d < width:
        exchange(values, recv, rank ^ d)
        values = values + recv
        d <<= 1
    return values


def vhdd_allreduce(buf: np.ndarray, counts: Sequence[int], rank: int, size: int, exchange: Exchange,
                   scratch: np.ndarray | None = None) -> None:
    """Adasum-reduce ``buf`` (flat; ``counts[i]`` elements of tensor i, back to back) in place.

    Args:
        rank, size: this rank's index in the group and the group's size (a power of two).
        exchange: the transport's sendrecv with a group member (see the module docstring).
        scratch: optional buffer of at least ``(buf.size + 1) // 2`` elements of ``buf``'s dtype.
    """
    if not is_power_of_two(size):
        raise ValueError(f"Adasum needs a power-of-two number of ranks, got {size}")
    if size == 1:
        return
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + int(c))
    if offsets[-1] != buf.size:
        raise ValueError(f"Adasum: tensor counts add up to {offsets[-1]}, buffer has {buf.size} elements")
    half = (buf.size + 1) // 2
    if scratch is None or scratch.size < half or scratch.dtype != buf.dtype:
        scratch = np.empty(half, buf.dtype)
    lo, hi = 0, buf.size
    regions: list[tuple[int, int, int]] = []  # (level, lo, hi) before each halving
    level = 1
    while level < size:
        peer = rank ^ level
        mid = lo + ((hi - lo) >> 1)
        left = (rank & level) == 0
        keep = (lo, mid) if left else (mid, hi)
        give = (mid, hi) if left else (lo, mid)
        regions.append((level, lo, hi))
        recv = scratch[:keep[1] - keep[0]]
        exchange(buf[give[0]:give[1]], recv, peer)
        lo, hi = keep
        parts = _slices(offsets, lo, hi)
        # [dot, |left|^2, |right|^2] per tensor, in the block's canonical (left, right) order.
        nd = np.empty(3 * len(parts))
        for i, (s, e) in enumerate(parts):
            dot, mine, theirs = _dot_norms(buf[s:e], recv[s - lo:e - lo])
            nd[3 * i] = dot
            nd[3 * i + 1], nd[3 * i + 2] = (mine, theirs) if left else (theirs, mine)
        nd = _block_sum(nd, rank, 2 * level, exchange)
        for i, (s, e) in enumerate(parts):
            if e == s:
                continue
            dot, lnorm, rnorm = nd[3 * i], nd[3 * i + 1], nd[3 * i + 2]
            acoeff, bcoeff = pair_coefficients(dot, lnorm, rnorm) if left else \
                pair_coefficients(dot, rnorm, lnorm)
            combine(buf[s:e], recv[s - lo:e - lo], acoeff, bcoeff)
        level <<= 1
    for level, plo, phi in reversed(regions):
        peer = rank ^ level
        mid = plo + ((phi - plo) >> 1)
        left = (rank & level) == 0
        other = (mid, phi) if left else (plo, mid)
        exchange(buf[lo:hi], buf[other[0]:other[1]], peer)
        lo, hi = plo, phi


def run_adasum(batch: Sequence[Response], entries: Sequence[Any], lane: Any) -> None:
    """Run one planned batch of Adasum allreduces on the host ``lane`` (``transport.Lane``).

    As upstream's ``AdasumMPIAllreduceOp``: the batch's tensors (all of one float dtype) are
    packed back to back into the lane's fusion buffer, prescaled, Adasum-reduced with per-tensor
    coefficients, postscaled and copied out. Everything but the VHDD schedule is the lane's, as
    for every other reduction: the items, a joined rank's zeros and the outputs of out-of-place
    entries (``buffers.batch_items``), the fusion buffer, the scaling (``ops.pack``/``unpack``/
    ``scale``, with ``plan.post_factors``: Adasum has no division). No widening: Adasum sends each
    dtype as it is (its arithmetic is its own, ``combine``), whatever the transport reduces. A
    joined rank's zeros leave its partners' vectors unchanged. The transport must offer
    ``exchange(send, recv, peer)`` (``HostTransport``).
    """
    ops, transport = lane.ops, lane.transport
    req = batch[0].request
    work = ops.dtype(req.dtype)
    post, div = post_factors(req.reduce_op, req.postscale, transport.group.size)
    items, _ = batch_items(batch, entries, ops)
    counts = [it.n for it in items]
    total = sum(counts)
    half = (total + 1) // 2
    if len(items) == 1:
        item = items[0]
        buf = item.o
        if not item.inplace or req.prescale != 1.0:
            ops.scale(buf, buf if item.inplace else item.x, req.prescale)
        scratch = ops.buffer(work, half)
    else:
        whole = ops.buffer(work, total + half)  # the packed tensors, then the exchange's half
        buf, scratch = whole[:total], whole[total:]
        segs, at = [], 0
        for i, n in enumerate(counts):
            segs.append((i, 0, n, at))
            at += n
        ops.pack(buf, items, segs, req.prescale, False)
    group = transport.group
    vhdd_allreduce(buf, counts, group.rank, group.size, transport.exchange, scratch)
    if len(items) == 1:
        if post != 1.0 or div != 1:
            ops.scale(buf, buf, post, div)
    else:
        ops.unpack(buf, items, segs, post, div)
