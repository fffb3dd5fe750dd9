"""Run planned batches of responses and fill in each entry's outputs: every operation once.

Called only from the engine thread. Each operation (allreduce, broadcast, allgather, alltoall,
reducescatter, a joined rank's zeros) is written once, over a ``transport.Lane``: the buffer
operations (``buffers.BufferOps``: NumPy arrays here, ``host_buffers.NumpyBuffers``; a device
plane's tensors) and a transport bound to the process set (``transport.Transport``: the job's CPU
backend, or a device plane's library). One widening rule (``dtypes.reduce_dtype``) and one scaling
rule (prescale on the way in, ``plan.post_factors`` on the way out, through the buffer operations)
hold for every lane. A reduction is three separate steps:

* ``plan.plan_reduction`` (pure) turns the agreed sizes into the ordered transport calls, piece by
  piece (the lane's ``chunk_bytes``; 0 on device planes): whole pieces of large tensors alone,
  small tensors and tails packed together. It never looks at memory, so every rank makes the same
  calls;
* the lane's placement (``placement``) decides, on this rank, whether each call is reduced where
  its tensors lie or copied through the reusable fusion buffer (huge pages on the host);
* ``buffers.run_reduction`` carries it out with the lane's buffer operations.

For data movement (allgather, broadcast, alltoall) any dtype, bool included, travels as unsigned
integers (``BufferOps.move``); broadcast fuses with the same planner, in bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from horovod.common.backends.base import EngineBackend, Group, SplitsGroups
from horovod.common.dtypes import FLOAT_DTYPES, HALF_DTYPES, logical_op, reduce_dtype
from horovod.common.engine.adasum import run_adasum
from horovod.common.engine.buffers import (
    Item,
    Reduction,
    batch_items,
    narrow_items,
    power_of_two,
    run_pipelined,
    run_reduction,
)
from horovod.common.engine.choice import TimedChoice
from horovod.common.engine.device import Planes, PlaneServices, is_plane
from horovod.common.engine.handles import Handle
from horovod.common.engine.hierarchy import Hierarchy, host_layout
from horovod.common.engine.host_buffers import NumpyBuffers
from horovod.common.engine.memo import StepMemo
from horovod.common.engine.outputs import OutputPool
from horovod.common.engine.pages import huge_page_empty
from horovod.common.engine.placement import HostPlacement
from horovod.common.engine.plan import PACKED, Call, plan_reduction, post_factors, work_op
from horovod.common.engine.transport import HostTransport, Lane
from horovod.common.engine.tunables import Tunables
from horovod.common.types import ReduceOp, Request, RequestType, Response

# ``activity(names, activity, begin)``: a step of a running batch begins or ends for those tensors.
Activity = Callable[[Sequence[str], str, bool], None]

__all__ = ["Entry", "Executor", "reducescatter_rows", "end_to_end", "UNTIMED_BYTES"]

# A batch of one call of at most this many bytes is copied through the huge-page buffer without
# timing the other way (``Executor.small_pages``): the copy costs less than the timing.
UNTIMED_BYTES = 16 << 10

class Entry:
    """A submitted operation on the submitting rank: its request, buffers and handle."""

    __slots__ = ("request", "inputs", "outputs", "handle", "state", "slot", "t_submit", "splits")

    def __init__(self, request: Request, inputs: list[np.ndarray], outputs: list[np.ndarray] | None,
                 handle: Handle, splits: np.ndarray | None = None) -> None:
        self.request = request
        self.inputs = inputs
        self.outputs = outputs
        self.handle = handle
        self.state = 0
        self.slot = -1
        self.t_submit = 0.0
        self.splits = splits


def _tunable(name: str, convert: Callable[[Any], Any]) -> Any:
    """A read-write property on ``self.tunables.<name>`` (read every batch; set as ``convert(value)``)."""

    def get(self: Any) -> Any:
        return getattr(self.tunables, name)

    def put(self: Any, value: Any) -> None:
        setattr(self.tunables, name, convert(value))
    return property(get, put, doc=f"``tunables.{name}``")


def reducescatter_rows(n: int, parts: int) -> list[int]:
    """Rows per member when ``n`` rows are split over ``parts`` members (first ones get one more)."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def end_to_end(arrays: Sequence[np.ndarray]) -> bool:
    """Whether C-contiguous ``arrays`` lie end to end in memory, in order (views of one flat
    buffer, as a flattened gradient set is)."""
    at = -1
    for a in arrays:
        if not a.flags.c_contiguous:
            return False
        start = a.__array_interface__["data"][0]
        if at >= 0 and start != at:
            return False
        at = start + a.nbytes
    return True


def _span(items: Sequence[Item]) -> np.ndarray | None:
    """One in-place view over the items' memory if they are in place and lie end to end, else None."""
    outs = [it.o for it in items if it.inplace]
    if len(outs) < len(items) or not end_to_end(outs):
        return None
    first = outs[0]
    return np.lib.stride_tricks.as_strided(first, shape=(sum(o.size for o in outs),), strides=(first.itemsize,))


def any_flat(batch: Sequence[Response], memo: dict[int, tuple[Sequence[Response], bool]], cap: int) -> bool:
    """Whether a response of ``batch`` is flat; remembered in ``memo`` (at most ``cap`` entries)
    for a memoized batch (a tuple: the same one every step of a cached workload, whose responses
    never change)."""
    if type(batch) is not tuple:
        return any(r.request.flat for r in batch)
    seen = memo.get(id(batch))
    if seen is not None and seen[0] is batch:
        return seen[1]
    flat = any(r.request.flat for r in batch)
    if len(memo) >= cap:
        memo.clear()
    memo[id(batch)] = (batch, flat)
    return flat


def reduction_of(req: Any, size: int, lane: Lane, dtype_info: dict[tuple[Any, ...], tuple[Any, bool, bool]]
                 ) -> Reduction:
    """How ``req`` reduces over ``size`` ranks on ``lane``: the widening rule
    (``dtypes.reduce_dtype``) and the scaling rule (``plan.post_factors``), the same for every
    lane. ``dtype_info``: the caller's table of the dtype rule per (dtype, transport's native
    dtypes, buffer kind)."""
    ops = lane.ops
    key = (req.dtype, lane.transport.native, type(ops))
    info = dtype_info.get(key)
    if info is None:
        work = reduce_dtype(req.dtype, lane.transport.native, lane.transport.name)
        info = dtype_info[key] = (ops.dtype(work), work != req.dtype, req.dtype in FLOAT_DTYPES)
    op = logical_op(req.dtype, work_op(req.reduce_op))
    post, div = post_factors(req.reduce_op, req.postscale, size)
    exact = info[2] and op == ReduceOp.SUM and power_of_two(post / div)
    return Reduction(op, req.prescale, post, div, info[0], info[1], exact)


class Executor:
    """Executes batches for one engine: every operation once, over a ``Lane`` (the host one, or a
    device plane's)."""

    def __init__(self, backend: EngineBackend, groups: dict[int, Group], rank: int, tunables: Tunables,
                 hostnames: Sequence[str] | None = None, timeout_s: float = 30.0,
                 secret: str | None = None, memo: StepMemo | None = None) -> None:
        self.backend = backend
        self.groups = groups
        self.rank = rank
        self.tunables = tunables
        self.hostnames = list(hostnames) if hostnames is not None else None
        # The observers' ``activity(names, activity, begin)`` (the batch runner's ``observe``):
        # the steps inside a batch (the timeline's rows); None: nobody records them.
        self.activity: Activity | None = None
        self.planes = Planes(PlaneServices(backend, tunables, timeout_s,
                                           tuple(hostnames) if hostnames is not None else None, secret))
        self._hierarchies: dict[tuple[int, ...], Hierarchy | None] = {}
        # The runner's step memo (``memo.py``): this executor's memos of a cached step are tables of it.
        self.memo = memo = StepMemo() if memo is None else memo
        self._outputs = OutputPool()  # out-of-place allreduce/broadcast, allgather, reducescatter results, warm
        self._ops = NumpyBuffers(huge_page_empty, self._outputs.empty, memo)
        self.placement = HostPlacement(lambda: self.tunables.max_tensor_bytes,
                                       pins_pages=bool(getattr(backend, "pins_pages", True)))
        # Per repeated batch, whether memory not on huge pages is reduced where it lies or copied
        # through the huge-page buffer: timed both ways (``choice.py``); copies until measured.
        self.small_pages = TimedChoice(False, memo.choices, StepMemo.CHOICES)
        self._lanes: dict[int, tuple[Group, Lane]] = {}  # id(group) -> (the group, its host lane)
        # plan_reduction is pure: its calls, by its arguments (a cached step plans the same
        # sizes with the same tunables every step). Bounded; the key holds every argument, and the
        # calls are tuples of named tuples (immutable), so a hit is the fresh computation.
        self._calls: dict[tuple[Any, ...], tuple[Call, ...]] = memo.calls
        # (dtype name, transport's native dtypes, buffer kind) -> (work dtype, whether it widens,
        # float): per process, keyed by value (not a step memo; see ``memo.py``)
        self._dtype_info: dict[tuple[Any, ...], tuple[Any, bool, bool]] = {}
        # id(batch) -> (batch, whether a response of it is flat): ``any_flat``
        self._flat_batches: dict[int, tuple[Sequence[Response], bool]] = memo.flat
        # id(request) -> (request, lane, group size, its Reduction): ``_reduction``
        self._reductions: dict[int, tuple[Any, Lane, int, Reduction]] = memo.reductions
        # Set by the runner around a batch whose data came with the round's negotiation
        # (``carry.py``): makes each call's reducer, which reduces every rank's carried data
        # into the call's buffer instead of calling the transport.
        self.carried: Callable[[Reduction], Callable[[np.ndarray], None]] | None = None

    CALLS_MEMO_SIZE = StepMemo.CALLS

    def _plan_reduction(self, sizes: Sequence[int], itemsize: int, chunk: int, cut: int, fuse: bool,
                        widen: bool = False, alone: int = 0) -> tuple[Call, ...]:
        """``plan.plan_reduction``, memoized on all of its arguments."""
        key = (tuple(sizes), itemsize, chunk, cut, fuse, widen, alone)
        calls = self._calls.get(key)
        if calls is None:
            calls = plan_reduction(sizes, itemsize, chunk, cut, fuse, widen, alone)
            if len(self._calls) >= self.CALLS_MEMO_SIZE:
                self._calls.clear()
            self._calls[key] = calls
        return calls

    # ------------------------------------------------------------------ tunables (read every batch)
    max_tensor_bytes = _tunable("max_tensor_bytes", int)
    chunk_bytes = _tunable("chunk_bytes", int)
    hierarchical_allreduce = _tunable("hierarchical_allreduce", bool)
    hierarchical_allgather = _tunable("hierarchical_allgather", bool)

    @property
    def fusion_enabled(self) -> bool:
        return self.tunables.fusion_threshold > 0

    # ------------------------------------------------------------------ lanes
    def host_lane(self, group: Group) -> Lane:
        """The job's CPU transport on NumPy buffers, for ``group`` (chunked, huge-page placement)."""
        made = self._lanes.get(id(group))
        chunk = self.tunables.chunk_bytes  # a tunable: the lane is made again when it changes
        if made is None or made[0] is not group or made[1].chunk_bytes != chunk:
            if len(self._lanes) > 64:  # process sets added and removed
                self._lanes.clear()
            tr = HostTransport(self.backend, group, self.tunables, self._hierarchy)
            made = self._lanes[id(group)] = (group, Lane(self._ops, tr, self.placement, chunk, True))
        return made[1]

    def _reduction(self, req: Any, size: int, lane: Lane) -> Reduction:
        """``reduction_of``, remembered for a cached step's request (the same object every step)."""
        known = self._reductions.get(id(req))
        if known is not None and known[0] is req and known[1] is lane and known[2] == size:
            return known[3]
        red = reduction_of(req, size, lane, self._dtype_info)
        StepMemo.full(self._reductions, StepMemo.REDUCTIONS)
        self._reductions[id(req)] = (req, lane, size, red)
        return red

    # ------------------------------------------------------------------ entry point
    def run(self, batch: Sequence[Response], entries: Sequence[Any]) -> None:
        """Execute one batch; entries[i] is this rank's Entry for batch[i] (None if it has none: a joined
        rank's, which takes part with zeros)."""
        req = batch[0].request
        kind = req.kind
        group = self.groups[req.process_set_id]
        act = self.activity
        if is_plane(req.device):  # framework-owned (GPU) tensors: the device plane's lane
            with self.planes.lane(batch, entries, group) as lane:
                if act is None:
                    self._execute(kind, batch, entries, group, lane, None)
                    return
                names = [r.name for r in batch]
                label = lane.transport.name + "_" + _ACTIVITY.get(kind, kind.upper)
                act(names, label, True)
                try:
                    self._execute(kind, batch, entries, group, lane, None)
                finally:
                    act(names, label, False)
        elif kind == RequestType.ALLREDUCE and req.reduce_op == ReduceOp.ADASUM:
            run_adasum(batch, entries, self.host_lane(group))
        else:
            self._execute(kind, batch, entries, group, self.host_lane(group), act)

    def _execute(self, kind: RequestType, batch: Sequence[Response], entries: Sequence[Any], group: Group,
                 lane: Lane, act: Activity | None) -> None:
        """Run one batch on ``lane``; ``act``: the observers' steps (None: not recorded)."""
        if act is not None and not lane.steps:
            act = None  # (a lane whose steps the timeline does not show)
        if kind == RequestType.ALLREDUCE:
            self._allreduce(batch, entries, group, lane, act)
        elif kind == RequestType.BROADCAST:
            self._broadcast(batch, entries, group, lane, act)
        elif kind == RequestType.ALLGATHER:
            allgather(entries[0], lane)
        elif kind == RequestType.ALLTOALL:
            alltoall(entries[0], lane)
        elif kind == RequestType.REDUCESCATTER:
            self._reducescatter(entries[0], group, lane)


    # ------------------------------------------------------------------ allreduce
    def _allreduce(self, batch: Sequence[Response], entries: Sequence[Any], group: Group, lane: Lane,
                   activity: Activity | None) -> None:
        """Reduce a batch piece by piece, each piece scaled and copied while it is hot in cache.

        ``plan.plan_reduction`` cuts the batch into transport calls from the agreed sizes alone;
        the lane's ``placement`` picks, on this rank, whether each call is reduced in the tensors'
        memory or through a fusion buffer; ``buffers.run_reduction`` carries it out. On a chunked
        lane, a response whose tensors every rank holds end to end (``Request.flat``) is planned
        as one item of their total size (the raw schedule of a flat buffer); a rank whose memory
        is not one span gathers those pieces through the buffer: the same transport calls.
        """
        req = batch[0].request
        red = self._reduction(req, group.size, lane)
        chunk = lane.chunk_bytes
        ops = lane.ops
        items, starts = batch_items(batch, entries, ops)
        if req.dtype in HALF_DTYPES and ops is self._ops:
            wire = ops.dtype(req.dtype)
            if narrow_items(items, wire):  # a compression's wider arrays, narrowed in the buffer
                red = red._replace(narrow=wire)
        groups: dict[int, tuple[int, list[int]]] = {}
        index: list[int] = []
        placement = lane.placement
        if not (chunk > 0 and any_flat(batch, self._flat_batches, self.CALLS_MEMO_SIZE)):
            sizes = [it.n for it in items]
        else:
            items, sizes = self._flat_items(batch, items, starts, groups, index)
        tun = self.tunables
        itemsize = red.work.itemsize
        calls = self._plan_reduction(sizes, itemsize, chunk, tun.max_tensor_bytes, tun.fusion_threshold > 0,
                                     red.widen, tun.alone_bytes)
        carried = self.carried  # the data came with the negotiation: no transport call
        if carried is None:
            # Several calls in flight where the transport has asynchronous reductions (Gloo), unless
            # an observer records each call's copy and transfer steps (they would overlap there).
            starter = getattr(lane.transport, "starter", None)
            started = starter(red.op) if starter is not None and activity is None and len(calls) > 1 else None
            if started is not None and isinstance(ops, NumpyBuffers):
                run_pipelined(calls, items, ops, red, started[0], started[1], placement,
                              index if groups else None, groups)
                return
        args = (calls, items, ops, red, lane.transport.reducer(red.op) if carried is None else carried(red),
                placement, activity, lane.transport.name + "_ALLREDUCE", index if groups else None, groups)
        if (carried is None and placement is self.placement and placement.pins_pages and not red.widen
                and red.narrow is None and (len(calls) > 1 or (calls and calls[0].size * itemsize > UNTIMED_BYTES))):
            placement.run_chosen(self.small_pages, batch, run_reduction, args)  # small pages: timed
        else:
            run_reduction(*args)

    def _flat_items(self, batch: Sequence[Response], items: Sequence[Item], starts: list[int],
                    groups: dict[int, tuple[int, list[int]]], index: list[int]) -> tuple[list[Item], list[int]]:
        """Host items with each flat response's tensors as one item (see ``_allreduce``)."""
        placement = self.placement
        placement.owners.clear()
        starts = starts + [len(items)]
        sizes: list[int] = []
        spans: list[Item] = []
        for r, resp in enumerate(batch):
            first, stop = starts[r], starts[r + 1]
            mine: Sequence[Item] = items[first:stop]
            if resp.request.flat and stop - first > 1:
                span = _span(mine)
                if span is None:  # planned as one item, held here as several
                    offsets = [0]
                    for it in mine:
                        offsets.append(offsets[-1] + it.n)
                    groups[len(sizes)] = (len(spans), offsets)
                    index.append(len(spans))
                    sizes.append(offsets[-1])
                    spans.extend(mine)
                    continue
                placement.owners[id(span)] = mine[0].o
                mine = [Item(span, span, True, resp.name, span.size)]
            for it in mine:
                index.append(len(spans))
                sizes.append(it.n)
                spans.append(it)
        return spans, sizes

    def _hierarchy(self, group: Group) -> Hierarchy | None:
        """The set's local and cross groups, made on first use (by all of the set's members, which
        run the same batch); None when the hierarchy does not apply (see ``hierarchy.host_layout``)."""
        key = tuple(group.ranks)
        if key in self._hierarchies:
            cached = self._hierarchies[key]
            if cached is None or cached.group is group:
                return cached
        backend = self.backend
        hier = None
        if self.hostnames is not None and isinstance(backend, SplitsGroups):
            layout = host_layout(group.ranks, self.hostnames)
            if layout is not None:
                hier = Hierarchy(backend, group, *layout)
        self._hierarchies[key] = hier
        return hier

    # ------------------------------------------------------------------ broadcast
    def _broadcast(self, batch: Sequence[Response], entries: Sequence[Any], group: Group, lane: Lane,
                   activity: Activity | None) -> None:
        """The same plan as a reduction's, unchunked, in bytes: tensors above ``max_tensor_bytes``
        alone, the others fused into one call."""
        req = batch[0].request
        root = group.ranks.index(req.root_rank)
        is_root = group.rank == root
        ops, tr = lane.ops, lane.transport
        items: list[Item] = []
        moves: list[Any] = []
        for entry in entries:
            xs = ops.tensors(entry.inputs)
            entry.outputs = outs = ops.broadcast_outputs(xs, entry.outputs, is_root)
            for o in outs:
                b = ops.bytes(o)
                items.append(Item(b, b, True, "", b.shape[0]))
                moves.append(ops.move(o)[0])
        names = [r.name for r in batch] if activity is not None else []
        act = tr.name + "_BCAST"
        for call in self._plan_reduction([it.n for it in items], 1, 0, self.max_tensor_bytes,
                                         self.fusion_enabled):
            segs = call.segments
            if call.kind == PACKED and len(segs) > 1:
                buf = ops.buffer(ops.dtype("uint8"), call.size)
                if is_root:
                    ops.pack(buf, items, segs, 1.0, False)
                if activity is not None:
                    activity(names, act, True)
                tr.broadcast(buf, root)
                if activity is not None:
                    activity(names, act, False)
                if not is_root:
                    ops.unpack(buf, items, segs, 1.0, 1)
            else:
                tr.broadcast(moves[segs[0][0]], root)

    # ------------------------------------------------------------------ reducescatter
    def _reducescatter(self, entry: Any, group: Group, lane: Lane) -> None:
        """Each tensor widened and prescaled into a copy as an allreduce's fusion buffer is (the
        same ``pack``), reduced and scattered, then scaled (and narrowed) into the result."""
        ops, tr = lane.ops, lane.transport
        red = self._reduction(entry.request, group.size, lane)
        outputs = []
        for x in ops.tensors(entry.inputs):
            shape = tuple(x.shape)
            send = ops.flat(x)
            n = send.shape[0]
            scratch = red.widen or red.pre != 1.0
            if scratch:
                buf = ops.empty((n,), red.work)
                ops.pack(buf, (Item(send, send, True, "", n),), ((0, 0, n, 0),), red.pre, red.widen)
                send = buf
            rows = reducescatter_rows(shape[0], group.size)
            row = _prod(shape[1:])
            recv = ops.result((rows[group.rank],) + shape[1:], red.work)
            tr.reducescatter(send, ops.flat(recv), [r * row for r in rows], red.op, scratch)
            if red.widen or (red.scaled and not _scales_in_place(recv)):
                out = ops.result(tuple(recv.shape), x.dtype)
                ops.scale(ops.flat(out), ops.flat(recv), red.post, red.div)
                recv = out
            elif red.scaled:
                ops.scale(ops.flat(recv), ops.flat(recv), red.post, red.div)
            outputs.append(recv)
        entry.outputs = outputs


_ACTIVITY = {RequestType.BROADCAST: "BCAST"}


def _scales_in_place(a: Any) -> bool:
    """Whether a reduce-scatter's result is scaled where it lies (host float32/float64: the same
    rounding as into a second buffer; 16-bit results are scaled in float32 into a copy)."""
    return isinstance(a, np.ndarray) and a.dtype.kind == "f" and a.dtype.itemsize >= 4


def allgather(entry: Any, lane: Lane) -> None:
    ops, tr = lane.ops, lane.transport
    xs = ops.tensors(entry.inputs)
    # First dimensions travel over the CPU transport: sizing the outputs needs no device sync.
    all_dims = tr.allgather_ints(np.array([x.shape[0] for x in xs], np.int64))
    outputs = []
    for i, x in enumerate(xs):
        shape = tuple(x.shape)
        out = ops.result((int(all_dims[:, i].sum()),) + shape[1:], x.dtype)
        send, units = ops.move(x)
        row = _prod(shape[1:]) * units
        tr.allgatherv(send, ops.move(out)[0], [int(c) * row for c in all_dims[:, i]])
        outputs.append(out)
    entry.outputs = outputs


def alltoall(entry: Any, lane: Lane) -> None:
    ops, tr = lane.ops, lane.transport
    x = ops.tensors(entry.inputs)[0]
    splits = np.asarray(entry.splits, np.int64)
    recv_splits = tr.alltoall_ints(splits)
    shape = tuple(x.shape)
    out = ops.empty((int(recv_splits.sum()),) + shape[1:], x.dtype)
    send, units = ops.move(x)
    row = _prod(shape[1:]) * units
    counts = [int(s) * row for s in splits]
    tr.alltoallv(ops.piece(send, 0, sum(counts)), counts, ops.move(out)[0],
                 [int(s) * row for s in recv_splits])
    entry.outputs = [(out, recv_splits.astype(np.int32))]


def _prod(dims: Sequence[int]) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n

