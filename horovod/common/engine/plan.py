"""The reduction planner: agreed tensor sizes -> the ordered transport calls, piece by piece. PURE.

Every rank of a set plans a batch from what negotiation agreed (the tensors' sizes, the dtype, the
tunables), never from where its own tensors lie in memory, so every rank makes the same transport
calls in the same order. Where a rank reduces each call (in its tensors' memory, or through a
fusion buffer) is its own choice (``placement``); what the buffers are (NumPy arrays, torch device
tensors) is the buffer operations' (``buffers``).

The schedule (``Tunables.chunk_bytes`` = ``chunk`` bytes, ``max_tensor_bytes`` = ``cut``):

* chunked (``chunk`` > 0, the host default): an item of at least ``alone`` bytes (default: one
  piece; ``Tunables.alone_bytes``) or above ``cut`` is cut into whole pieces of at most one piece,
  each a call alone (``PIECE``); its short tail (at most ``cut`` bytes, and below ``alone``), the
  small items and, when the reduction widens the dtype, everything else fill a packed call of
  one piece (``PACKED``), which is flushed when full and before the next item's pieces begin (so
  that views of one flat buffer form runs that may be reduced where they lie). With ``alone``
  below the piece size (the Gloo plane's large pieces), an item between the two is one call of
  its own, reduced where it lies, rather than copied into a packed piece, and the packed call is
  flushed only when full (the small items between large ones, a model's biases and norms, would
  otherwise make as many tiny calls);
* unchunked (``chunk`` 0, the device planes): items above ``cut`` are one call each (``WHOLE``),
  the others share one packed call after them;
* without fusion every item is a call of its own.

Zero-size items make no call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from horovod.common.types import ReduceOp

__all__ = ["Call", "PACKED", "PIECE", "WHOLE", "plan_reduction", "post_factors", "work_op"]

PACKED = 0  # several items' elements, packed side by side (a fusion buffer, or a span in place)
PIECE = 1  # a whole piece of one large item
WHOLE = 2  # one item entire (unchunked schedule)


class Call(NamedTuple):
    """One transport call: ``size`` elements made of ``segments`` (item, start, stop, offset), the
    elements ``[start, stop)`` of item ``item`` at element ``offset`` of the call's buffer."""

    kind: int
    size: int
    segments: tuple[tuple[int, int, int, int], ...]


def plan_reduction(sizes: Sequence[int], itemsize: int, chunk_bytes: int, cut: int, fuse: bool,
                   widen: bool = False, alone_bytes: int = 0) -> tuple[Call, ...]:
    """The ordered calls reducing items of ``sizes`` elements of ``itemsize`` bytes (the dtype the
    reduction runs in). ``cut``: items above it are never packed (``max_tensor_bytes``); ``fuse``:
    whether packing is enabled at all; ``widen``: the reduction runs in a wider dtype than the
    tensors (every element then goes through a buffer, so everything is packed); ``alone_bytes``:
    on a chunked schedule without widening, items (and tails) of at least this many bytes are
    calls of their own, never packed (0, or above the piece size: the piece size)."""
    chunk = chunk_bytes // itemsize if chunk_bytes > 0 else 0
    alone = chunk
    if chunk > 0 and not widen and 0 < alone_bytes < chunk_bytes:
        # (a widened reduction copies every element through the buffer anyway: packed, fewer calls)
        alone = max(1, -(-alone_bytes // itemsize))
    if chunk > 0:
        cap = chunk
    else:  # one packed call for everything that is packed
        cap = sum(n for n in sizes if widen or (fuse and n * itemsize <= cut))
    cap = max(cap, 1)
    calls: list[Call] = []
    pack: list[tuple[int, int, int, int]] = []
    fill = 0
    for idx, n in enumerate(sizes):
        nbytes = n * itemsize
        start = 0
        if chunk > 0:
            if not fuse:
                stop = n
            elif n >= alone or nbytes > cut:
                tail = n % chunk
                stop = n - tail if tail and tail < alone and tail * itemsize <= cut else n
            else:
                stop = 0
            step, kind = chunk, PIECE
        elif not widen and not (fuse and nbytes <= cut):
            stop = step = n
            kind = WHOLE
        else:
            stop = step = 0
            kind = PACKED
        if stop > 0:
            if chunk > 0 and pack and alone == chunk:
                calls.append(Call(PACKED, fill, tuple(pack)))
                pack, fill = [], 0
            for s in range(0, stop, step):
                e = min(s + step, stop)
                calls.append(Call(kind, e - s, ((idx, s, e, 0),)))
            start = stop
        while start < n:
            take = n - start
            if take > cap - fill:
                take = cap - fill
            pack.append((idx, start, start + take, fill))
            fill += take
            start += take
            if fill == cap:
                calls.append(Call(PACKED, fill, tuple(pack)))
                pack, fill = [], 0
    if pack:
        calls.append(Call(PACKED, fill, tuple(pack)))
    return tuple(calls)  # immutable: a memo of it (``Executor._plan_reduction``) cannot be changed


def work_op(op: ReduceOp) -> ReduceOp:
    """The transport's reduction for ``op``: Average is a Sum followed by a division."""
    return ReduceOp.SUM if op == ReduceOp.AVERAGE else op


def post_factors(op: ReduceOp, postscale: float, size: int) -> tuple[float, int]:
    """(factor, divisor) applied after the reduction over a set of ``size`` ranks.

    A plain Average divides by the set's size, as the framework's own ``t / size`` does (exactly
    rounded: multiplying float32 by float32(1/3) is one ulp off for about a third of the values);
    an Average with a postscale factor multiplies once by ``postscale / size``.
    """
    if op != ReduceOp.AVERAGE:
        return postscale, 1
    if postscale == 1.0:
        return 1.0, size
    return postscale / size, 1
