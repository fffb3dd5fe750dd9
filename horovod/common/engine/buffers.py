"""The buffer seam: one reduction runner over a small set of buffer operations.

``plan.plan_reduction`` says which transport calls a batch makes; ``placement`` says, on this rank,
whether a call is reduced where its tensors lie or through a fusion buffer; ``run_reduction``
carries the plan out with a ``BufferOps``: the only part that knows what a buffer is. The engine's
own ``NumpyBuffers`` (``host_buffers.py``) works on flat host arrays; a framework's device plane
supplies its own (the torch one on CUDA tensors, ``horovod/torch/_device_plane.py``). A new kind of
buffer is one class with these operations (JAX arrays on the CPU become NumPy views and need none).

Scaling (prescale, Average's division, postscale), join zeros and widening live here once:

* prescale is applied on the way in (into the buffer, or in place before the reduction);
* after the reduction, Average divides by the set's size (exactly rounded, as ``t / size``) and
  postscale multiplies (``plan.post_factors``); a power-of-two factor of an out-of-place float Sum
  is applied during the copy in, the reduction then runs in place (bit-identical, one pass);
* a joined rank contributes zeros of the agreed shapes (``zeros``);
* a dtype the transport cannot reduce is widened into the buffer and narrowed on the way out;
* a compression's narrowing (``Reduction.narrow``: float32 arrays reduced as float16 or bfloat16)
  happens on the way into the fusion buffer and its widening on the way out: one pass each way,
  in pieces hot in cache, never a 16-bit copy of the whole tensor (``NarrowingBuffers``: the host
  buffers' ``pack_narrowed``/``unpack_narrowed``).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, cast

import numpy as np

from horovod.common.engine.plan import Call

__all__ = ["BufferOps", "Item", "Reduction", "batch_items", "run_reduction", "run_pipelined", "SlotBuffers",
           "NarrowingBuffers", "Placement", "narrow_items"]

Segment = tuple[int, int, int, int]


class Item(NamedTuple):
    """One tensor of a batch on this rank: input, output (the same object when in place), the
    operation's name and the element count."""

    x: Any
    o: Any
    inplace: bool
    name: str
    n: int


class Reduction(NamedTuple):
    """How a batch is reduced: the transport's op, the scale factors and the work dtype."""

    op: Any
    pre: float
    post: float
    div: int
    work: Any  # the dtype the transport reduces in (a NumPy dtype, a torch dtype, ...)
    widen: bool  # work differs from the tensors' dtype: every element goes through a buffer
    exact_post: bool  # post / div is a power of two on a float Sum: may be applied on the way in
    # The batch's 16-bit dtype (a NumPy dtype) when some of this rank's items are wider arrays a
    # compression narrows to it on the way in and widens back on the way out (``narrow_items``);
    # None otherwise. A local matter: the plan and the transport calls are the same either way.
    narrow: Any = None

    @property
    def scaled(self) -> bool:
        return self.post != 1.0 or self.div != 1


def power_of_two(x: float) -> bool:
    m, _ = math.frexp(x)
    return m == 0.5


class BufferOps(Protocol):
    """What the runner needs of a kind of buffer. ``x``/``o`` are the items' own objects."""

    #: scale after the reduction once per batch (``scale_all``) rather than per call
    defer_scale: bool

    def piece(self, a: Any, start: int, stop: int) -> Any:
        """The flat elements ``[start, stop)`` of ``a`` (a view)."""

    def span(self, items: Sequence[Item], segs: Sequence[Segment], inplace_only: bool) -> Any:
        """One view of the outputs' memory covering ``segs`` if it is contiguous there (a single
        segment always is; several when they lie end to end), and all are in place when
        ``inplace_only``; else None."""

    def buffer(self, work: Any, n: int) -> Any:
        """A reusable fusion buffer of ``n`` elements of ``work`` (allocate)."""

    def outputs(self, inputs: Sequence[Any], given: Sequence[Any] | None) -> list[Any]:
        """The outputs an entry's caller gets: ``given`` (the caller's, or its inputs when in
        place) as this kind's objects, else new ones for an out-of-place operation (allocate)."""

    def items(self, name: str, inputs: Sequence[Any], outputs: Sequence[Any]) -> Sequence[Item]:
        """The items of one response's tensors (immutable where remembered)."""

    def item(self, new: Any, name: str, x: Any) -> Item:
        """The item of one tensor reduced in place (``items`` of ``[x], [x]``): ``batch_items``'
        per-tensor fast path; ``new`` is ``tuple.__new__``."""

    def recall(self, batch: Sequence[Any], entries: Sequence[Any]) -> tuple[Sequence[Item], list[int]] | None:
        """The items and starts of ``batch`` when it is a remembered one whose entries hand over
        the same tensors, in place, as then; else None (a kind without a batch memo: always)."""

    def remember(self, batch: Sequence[Any], entries: Sequence[Any], items: list[Item],
                 starts: list[int]) -> tuple[Sequence[Item], list[int]]:
        """Note a batch whose entries each hand over one tensor in place (for ``recall``); returns
        its items and starts (a kind without a batch memo: as given)."""

    def zeros(self, n: int, dtype: str) -> Any:
        """A joined rank's contribution: ``n`` zeros of the batch's dtype."""

    def scale(self, dst: Any, src: Any, factor: float, divisor: int = 1) -> None:
        """dst = src * factor / divisor (a copy when both are 1), rounded as the host path does."""

    def pack(self, buf: Any, items: Sequence[Item], segs: Sequence[Segment], pre: float, widen: bool) -> None:
        """Copy the segments' inputs into ``buf`` (widened, multiplied by ``pre``)."""

    def unpack(self, buf: Any, items: Sequence[Item], segs: Sequence[Segment], post: float, div: int) -> None:
        """Copy the reduced segments out of ``buf`` into the outputs, scaled (and narrowed)."""

    def scale_all(self, regions: Sequence[Any], post: float, div: int) -> None:
        """Scale reduced regions in place (when ``defer_scale``)."""

    # -- what the other operations need (data movement, reducescatter)
    def dtype(self, name: str) -> Any:
        """This kind's dtype object for a dtype name (``Reduction.work``)."""

    def tensors(self, inputs: Sequence[Any]) -> Sequence[Any]:
        """An entry's inputs as this kind's buffers (a binding may hand over wrappers)."""

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A new buffer (allocate)."""

    def result(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A new allgather or reduce-scatter result, which the caller keeps. The one policy for
        them: host NumPy results come warm from the output pool (a sharded model gathers and
        reduce-scatters buffers of the same sizes every step, and fresh memory costs a page fault
        per 4 KiB each time); a kind without such a pool allocates (``empty``: torch's caching
        allocator is the device's)."""

    def flat(self, a: Any) -> Any:
        """``a``'s elements as a flat view."""

    def move(self, a: Any) -> tuple[Any, int]:
        """A flat view of ``a`` that any dtype travels as, and its elements per element of ``a``."""

    def bytes(self, a: Any) -> Any:
        """``a``'s bytes as a flat view."""

    def broadcast_outputs(self, inputs: Sequence[Any], given: Sequence[Any] | None, is_root: bool) -> list[Any]:
        """A broadcast's outputs (``given``, else new); on the root they hold the inputs' values."""


class Placement(Protocol):
    """Where this rank reduces a call: a view of its tensors' memory, or None (a fusion buffer).
    A local choice: the transport calls are the same either way."""

    def region(self, call: Call, items: Sequence[Item], segs: Sequence[Segment], ops: BufferOps) -> Any:
        ...


def batch_items(batch: Sequence[Any], entries: Sequence[Any], ops: BufferOps
                ) -> tuple[Sequence[Item], list[int]]:
    """The items of a batch on this rank, and where each response's items start (a one-response
    batch's items are ``ops.items``' own: a tuple where it remembers them).

    Sets the outputs of out-of-place entries; a joined rank (entry None) contributes zeros of the
    agreed shapes."""
    found = ops.recall(batch, entries)  # a memoized batch of one in-place array per entry
    if found is not None:
        return found
    items: list[Item] = []
    starts: list[int] = []
    one = ops.item  # the one-tensor, in-place case without the general calls
    new = tuple.__new__
    ones = 0
    for resp, entry in zip(batch, entries):
        starts.append(len(items))
        if entry is not None:
            inputs = entry.inputs
            if len(inputs) == 1 and entry.outputs is inputs:
                items.append(one(new, resp.request.name, inputs[0]))
                ones += 1
                continue
        if entry is None:
            for shape in resp.request.shapes:
                n = 1
                for d in shape:
                    n *= d
                z = ops.zeros(n, resp.request.dtype)
                items.append(Item(z, z, True, resp.name, n))
            continue
        entry.outputs = ops.outputs(entry.inputs, entry.outputs)
        mine = ops.items(resp.name, entry.inputs, entry.outputs)
        if len(batch) == 1:
            return mine, starts  # as ``items`` made it (a tuple when remembered)
        items.extend(mine)
    if ones == len(batch):
        return ops.remember(batch, entries, items, starts)
    return items, starts


def run_reduction(calls: Sequence[Call], items: Sequence[Item], ops: BufferOps, red: Reduction,
                  reduce: Callable[[Any], None], placement: Placement,
                  activity: Callable[[Sequence[str], str, bool], None] | None = None,
                  act: str = "ALLREDUCE", index: list[int] | None = None,
                  groups: dict[int, tuple[int, list[int]]] | None = None) -> None:
    """Carry out ``calls`` over ``items``.

    Planned item ``k`` is ``items[index[k]]`` (``index`` None: ``items[k]``); ``groups`` maps a
    planned item held here by several items (a flat group whose memory is not one span on this
    rank) to (its first item, the element offsets of its items).
    """
    deferred: list[Any] = []
    # A reducer that writes the whole reduction without reading the buffer (the negotiation's
    # carried data, ``carry.BatchData.reducer``) needs this rank's data in no fusion buffer.
    fills = getattr(reduce, "fills", False)
    for call in calls:
        segs = call.segments if index is None else _physical(call.segments, index, groups or {})
        names = list(dict.fromkeys(items[i].name for i, *_ in segs)) if activity is not None else []
        narrowed = red.narrow is not None and _narrowed(items, segs, red.narrow)
        region = None if red.widen or narrowed else placement.region(call, items, segs, ops)
        if region is not None:
            if activity is not None:
                activity(names, act, True)
            _in_place(items, segs, region, ops, red, reduce, deferred)
            if activity is not None:
                activity(names, act, False)
            continue
        buf = ops.buffer(red.work, call.size)
        if activity is not None:
            activity(names, "MEMCPY_IN_FUSION_BUFFER", True)
            if not fills:
                _pack(ops, buf, items, segs, red, narrowed)
            activity(names, "MEMCPY_IN_FUSION_BUFFER", False)
            activity(names, act, True)
            reduce(buf)
            activity(names, act, False)
            activity(names, "MEMCPY_OUT_FUSION_BUFFER", True)
            _unpack(ops, buf, items, segs, red, narrowed)
            activity(names, "MEMCPY_OUT_FUSION_BUFFER", False)
        else:
            if not fills:
                _pack(ops, buf, items, segs, red, narrowed)
            reduce(buf)
            _unpack(ops, buf, items, segs, red, narrowed)
    if deferred:
        ops.scale_all(deferred, red.post, red.div)


def _pack(ops: BufferOps, buf: Any, items: Sequence[Item], segs: Sequence[Segment], red: Reduction,
          narrowed: bool) -> None:
    if narrowed:
        cast(NarrowingBuffers, ops).pack_narrowed(buf, items, segs, red)
    else:
        ops.pack(buf, items, segs, red.pre, red.widen)


def _unpack(ops: BufferOps, buf: Any, items: Sequence[Item], segs: Sequence[Segment], red: Reduction,
            narrowed: bool) -> None:
    if narrowed:
        cast(NarrowingBuffers, ops).unpack_narrowed(buf, items, segs, red)
    else:
        ops.unpack(buf, items, segs, red.post, red.div)


def narrow_items(items: Sequence[Item], wire: np.dtype) -> bool:
    """Whether some item of a batch of 16-bit dtype ``wire`` is a wider array (a compression's
    float32 tensor submitted to be reduced as ``wire``: ``collectives.allreduce_async(wire=)``)."""
    return any(it.x.dtype != wire for it in items)


def _narrowed(items: Sequence[Item], segs: Sequence[Segment], wire: np.dtype) -> bool:
    """Whether a call's segments hold a narrowed item (``narrow_items``, per call)."""
    return any(items[i].x.dtype != wire for i, *_ in segs)


class NarrowingBuffers(BufferOps, Protocol):
    """Buffer operations that narrow a compression's wider arrays in the fusion buffer
    (``Reduction.narrow``). Only host buffers narrow: the executor sets ``Reduction.narrow`` only
    when the lane's ops are the engine's own NumPy ones (``host_buffers.NumpyBuffers``)."""

    def pack_narrowed(self, buf: Any, items: Sequence[Item], segs: Sequence[Segment], red: Reduction) -> None:
        """``pack`` of a call holding narrowed items: each wider input rounded to ``red.narrow``
        on its way into ``buf``, then prescaled in the 16-bit type."""

    def unpack_narrowed(self, buf: Any, items: Sequence[Item], segs: Sequence[Segment], red: Reduction) -> None:
        """``unpack`` of a call holding narrowed items: scaled in the 16-bit type, then widened
        into each wider output."""


def _in_place(items: Sequence[Item], segs: Sequence[Segment], region: Any, ops: BufferOps, red: Reduction,
              reduce: Callable[[Any], None], deferred: list[Any]) -> None:
    """Reduce ``region`` (the outputs' memory of ``segs``), loading the input first if out of place."""
    post = _load(items, segs, region, ops, red)
    reduce(region)
    if post:
        _post_scale(region, ops, red, deferred)


def _load(items: Sequence[Item], segs: Sequence[Segment], region: Any, ops: BufferOps, red: Reduction) -> bool:
    """Make ``region`` hold this rank's contribution (an out-of-place input copied in, prescaled);
    whether the result still needs the post-scaling (``_post_scale``)."""
    src = None
    if len(segs) == 1:
        i, s, e, _ = segs[0]
        item = items[i]
        if not item.inplace:
            src = ops.piece(item.x, s, e)
    if src is not None and red.scaled and red.exact_post and red.pre == 1.0:
        # Scale during the copy, then reduce in place: one pass, bit-identical (a power of two).
        ops.scale(region, src, red.post, red.div)
        return False
    if red.pre != 1.0:
        ops.scale(region, region if src is None else src, red.pre)
    elif src is not None:
        ops.scale(region, src, 1.0)
    return red.scaled


def _post_scale(region: Any, ops: BufferOps, red: Reduction, deferred: list[Any]) -> None:
    if ops.defer_scale:
        deferred.append(region)
    else:
        ops.scale(region, region, red.post, red.div)


class SlotBuffers(BufferOps, Protocol):
    """Buffer operations with several fusion buffers per dtype (``run_pipelined``)."""

    def slot_buffer(self, work: Any, n: int, slot: int) -> Any:
        """Fusion buffer number ``slot`` (``buffer``'s is slot 0) of ``n`` elements of ``work``."""


Start = Callable[[Any], Callable[[], None]]


def run_pipelined(calls: Sequence[Call], items: Sequence[Item], ops: SlotBuffers, red: Reduction,
                  start: Start, depth: int, placement: Placement, index: list[int] | None = None,
                  groups: dict[int, tuple[int, list[int]]] | None = None) -> None:
    """``run_reduction`` with up to ``depth`` calls in flight: ``start(buf)`` begins a reduction on
    the transport's own threads and returns its wait. While call k moves, call k+1 is packed (or
    loaded in place) and started, then call k is waited for and unpacked while k+1 moves, so the
    copies overlap the transfers. The calls are the plan's, started in its order on every rank
    (the transport pairs them in that order); packed calls rotate over ``depth`` fusion buffers,
    so a buffer is never packed while a reduction on it is in flight.
    """
    pending: deque[tuple[Callable[[], None], Callable[[], None] | None]] = deque()
    deferred: list[Any] = []
    packed = 0
    try:
        for call in calls:
            segs = call.segments if index is None else _physical(call.segments, index, groups or {})
            narrowed = red.narrow is not None and _narrowed(items, segs, red.narrow)
            region = None if red.widen or narrowed else placement.region(call, items, segs, ops)
            finish: Callable[[], None] | None
            if region is not None:
                post = _load(items, segs, region, ops, red)
                wait = start(region)
                finish = functools.partial(_post_scale, region, ops, red, deferred) if post else None
            else:
                buf = ops.slot_buffer(red.work, call.size, packed % depth)
                packed += 1
                _pack(ops, buf, items, segs, red, narrowed)
                wait = start(buf)
                finish = functools.partial(_unpack, ops, buf, items, segs, red, narrowed)
            pending.append((wait, finish))
            if len(pending) >= depth:
                _finish(*pending.popleft())
        while pending:
            _finish(*pending.popleft())
    except BaseException:
        # A reduction still in flight writes into its buffer: let it end (or fail) before the
        # buffers are reused; the first error is the one raised.
        for wait, _ in pending:
            with contextlib.suppress(Exception):
                wait()
        raise
    if deferred:
        ops.scale_all(deferred, red.post, red.div)


def _finish(wait: Callable[[], None], finish: Callable[[], None] | None) -> None:
    wait()
    if finish is not None:
        finish()


def _physical(segs: Sequence[Segment], index: list[int], groups: dict[int, tuple[int, list[int]]]) -> list[Segment]:
    out: list[Segment] = []
    for k, a, b, at in segs:
        group = groups.get(k)
        if group is None:
            out.append((index[k], a, b, at))
            continue
        first, offsets = group
        j = 0
        while offsets[j + 1] <= a:
            j += 1
        while a < b:
            stop = min(b, offsets[j + 1])
            if stop > a:
                out.append((first + j, a - offsets[j], stop - offsets[j], at))
                at += stop - a
                a = stop
            j += 1
    return out
