"""Run planned batches of responses on the data transport and fill in each entry's outputs.

Called only from the engine thread. A reduction is three separate steps:

* ``plan.plan_reduction`` (pure) turns the agreed sizes into the ordered transport calls, piece by
  piece (``Tunables.chunk_bytes``): whole pieces of large tensors alone, small tensors and tails
  packed together a piece at a time. It never looks at memory, so every rank makes the same calls;
* ``placement.HostPlacement`` decides, on this rank, whether each call is reduced where its
  tensors lie (a large tensor's piece, or a run of views of one flat buffer, on huge pages) or
  copied through the reusable huge-page fusion buffer;
* ``buffers.run_reduction`` carries it out with ``NumpyBuffers`` (scaling, widening of dtypes the
  transport cannot reduce, float16 to float32, and join zeros live there once; a device plane runs
  the same runner with its own buffer operations).

For data movement (allgather, broadcast, alltoall) any dtype, bool included, travels as unsigned
integers of the same width; broadcast fuses with the same planner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from horovod.common.backends.base import Group
from horovod.common.engine.adasum import AdasumRunner
from horovod.common.engine.buffers import (
    Item,
    NumpyBuffers,
    Reduction,
    batch_items,
    power_of_two,
    run_reduction,
    scale_array,
)
from horovod.common.engine.device import Planes, PlaneServices, is_plane
from horovod.common.engine.hierarchy import Hierarchy, host_layout
from horovod.common.engine.outputs import OutputPool
from horovod.common.engine.placement import HostPlacement
from horovod.common.engine.plan import PACKED, plan_reduction, post_factors, work_op
from horovod.common.engine.timeline import Timeline
from horovod.common.engine.tunables import Tunables
from horovod.common.types import ReduceOp, RequestType, Response

__all__ = ["Entry", "Executor", "reducescatter_rows", "aligned_empty", "end_to_end", "SMALL_OUTPUT_BYTES"]

_MOVE_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class Entry:
    """A submitted operation on the submitting rank: its request, buffers and handle."""

    __slots__ = ("request", "inputs", "outputs", "handle", "state", "slot", "t_submit", "splits")

    def __init__(self, request: Any, inputs: list[np.ndarray], outputs: list[np.ndarray] | None,
                 handle: Any, splits: np.ndarray | None = None) -> None:
        self.request = request
        self.inputs = inputs
        self.outputs = outputs
        self.handle = handle
        self.state = 0
        self.slot = -1
        self.t_submit = 0.0
        self.splits = splits


_ALIGN = 64
# Outputs below this size are not aligned (copying them costs less than aligning them).
SMALL_OUTPUT_BYTES = 4096


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary.

    Frameworks wrap aligned NumPy memory without copying (TensorFlow copies unaligned arrays
    returned from ``numpy_function``); ``np.empty`` only guarantees 16 bytes.
    """
    dtype = np.dtype(dtype)
    n = 1
    for d in shape:
        n *= d
    if n * dtype.itemsize < SMALL_OUTPUT_BYTES:
        return np.empty(shape, dtype)
    raw = np.empty(n * dtype.itemsize + _ALIGN, np.uint8)
    off = (-raw.__array_interface__["data"][0]) % _ALIGN
    return raw[off:off + n * dtype.itemsize].view(dtype).reshape(shape)


_HUGE_PAGE = 2 * 1024 * 1024


def huge_page_empty(nbytes: int) -> np.ndarray:
    """Uninitialised bytes starting on a 2 MiB boundary, backed by transparent huge pages where the
    kernel allows them.

    NumPy asks the kernel for huge pages (``madvise(MADV_HUGEPAGE)``) for allocations of 4 MiB and
    more; the aligned start lets whole 2 MiB pieces sit on one huge page each. A reduction piece on
    huge pages is up to twice as fast as one on 4 KiB pages (Open MPI's single-copy transfer pins
    every page; measured with ResNet-50 gradients at np=2: 13 ms packed on huge pages vs 20 ms on
    4 KiB pages vs 27 ms in the tensors' own memory, raw flat buffer 10.5 ms).
    """
    raw = np.empty(max(nbytes + _HUGE_PAGE, 2 * _HUGE_PAGE), np.uint8)
    off = (-raw.__array_interface__["data"][0]) % _HUGE_PAGE
    return raw[off:off + nbytes]


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


def _move_view(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(_MOVE_DTYPES[a.dtype.itemsize])


class Executor:
    """Executes batches for one engine."""

    def __init__(self, backend: Any, groups: dict[int, Group], rank: int, tunables: Tunables,
                 timeline: Callable[[], Timeline | None], hostnames: Sequence[str] | None = None) -> None:
        self.backend = backend
        self.groups = groups
        self.rank = rank
        self.tunables = tunables
        self.hostnames = list(hostnames) if hostnames is not None else None
        self._timeline = timeline
        self._native = backend.reduce_dtypes()
        self._work: dict[str, np.dtype] = {}
        self._dtype_info: dict[str, tuple[np.dtype, np.dtype, bool]] = {}
        self._act = backend.name.upper() + "_"
        self.planes = Planes(PlaneServices(backend, tunables, timeline))
        self._hierarchies: dict[tuple[int, ...], Hierarchy | None] = {}
        self._outputs = OutputPool()  # out-of-place allreduce/broadcast results, recycled warm
        self._ops = NumpyBuffers(huge_page_empty, self._outputs.empty)
        self.placement = HostPlacement(lambda: self.tunables.max_tensor_bytes)
        # plan_reduction is pure: its calls, by its arguments (a cached step plans the same
        # sizes with the same tunables every step). Bounded; the key holds every argument.
        self._calls: dict[tuple[Any, ...], list[Any]] = {}

    CALLS_MEMO_SIZE = 256

    def _plan_reduction(self, sizes: Sequence[int], itemsize: int, chunk: int, cut: int, fuse: bool,
                        widen: bool = False) -> list[Any]:
        """``plan.plan_reduction``, memoized on all of its arguments (the result is never mutated)."""
        key = (tuple(sizes), itemsize, chunk, cut, fuse, widen)
        calls = self._calls.get(key)
        if calls is None:
            calls = plan_reduction(sizes, itemsize, chunk, cut, fuse, widen)
            if len(self._calls) >= self.CALLS_MEMO_SIZE:
                self._calls.clear()
            self._calls[key] = calls
        return calls

    # ------------------------------------------------------------------ tunables (read every batch)
    @property
    def max_tensor_bytes(self) -> int:
        return self.tunables.max_tensor_bytes

    @max_tensor_bytes.setter
    def max_tensor_bytes(self, value: int) -> None:
        self.tunables.max_tensor_bytes = int(value)

    @property
    def chunk_bytes(self) -> int:
        return self.tunables.chunk_bytes

    @chunk_bytes.setter
    def chunk_bytes(self, value: int) -> None:
        self.tunables.chunk_bytes = int(value)

    @property
    def fusion_enabled(self) -> bool:
        return self.tunables.fusion_threshold > 0

    @property
    def hierarchical_allreduce(self) -> bool:
        return self.tunables.hierarchical_allreduce

    @hierarchical_allreduce.setter
    def hierarchical_allreduce(self, value: bool) -> None:
        self.tunables.hierarchical_allreduce = bool(value)

    @property
    def hierarchical_allgather(self) -> bool:
        return self.tunables.hierarchical_allgather

    @hierarchical_allgather.setter
    def hierarchical_allgather(self, value: bool) -> None:
        self.tunables.hierarchical_allgather = bool(value)

    # ------------------------------------------------------------------ helpers
    def _work_dtype(self, name: str) -> np.dtype:
        """The dtype a reduction of ``name`` runs in (float16 widens to float32 where needed)."""
        work = self._work.get(name)
        if work is None:
            dtype = np.dtype(name)
            if name in self._native:
                work = dtype
            elif dtype.kind == "f":
                work = np.dtype(np.float32)
            else:
                raise TypeError(f"the {self.backend.name} backend cannot reduce {name} tensors")
            self._work[name] = work
        return work

    def _dtypes(self, name: str) -> tuple[np.dtype, np.dtype, bool]:
        """(work dtype, dtype, whether the reduction widens) for a dtype name, cached."""
        info = self._dtype_info.get(name)
        if info is None:
            work = self._work_dtype(name)
            dtype = np.dtype(name)
            info = self._dtype_info[name] = (work, dtype, work != dtype)
        return info

    # ------------------------------------------------------------------ entry point
    def run(self, batch: Sequence[Response], entries: Sequence[Any], joined: bool) -> None:
        """Execute one batch; entries[i] is this rank's Entry for batch[i] (None if it has none)."""
        req = batch[0].request
        kind = req.kind
        group = self.groups[req.process_set_id]
        tl = self._timeline()
        if tl is not None:
            for r in batch:
                tl.begin(r.name, kind.upper)
        if is_plane(req.device):  # framework-owned (GPU) tensors: the device plane runs them
            self.planes.run(batch, entries, group)
        elif kind == RequestType.ALLREDUCE and req.reduce_op == ReduceOp.ADASUM:
            self._adasum_runner().run(batch, entries, group, aligned_empty)
        elif kind == RequestType.ALLREDUCE:
            self._allreduce(batch, entries, group, tl)
        elif kind == RequestType.BROADCAST:
            self._broadcast(batch, entries, group, tl)
        elif kind == RequestType.ALLGATHER:
            self._allgather(entries[0], group, tl)
        elif kind == RequestType.ALLTOALL:
            self._alltoall(entries[0], group, tl)
        elif kind == RequestType.REDUCESCATTER:
            self._reducescatter(entries[0], group, tl)
        if tl is not None:
            for r in batch:
                tl.end(r.name, {"dtype": r.request.dtype,
                                "shape": str([list(s) for s in r.request.shapes])})

    def _adasum_runner(self) -> AdasumRunner:
        runner = self.__dict__.get("_adasum")
        if runner is None:
            runner = self._adasum = AdasumRunner(self.backend)
        return runner

    def _activity(self, tl: Timeline | None, names: Sequence[str], activity: str, begin: bool) -> None:
        if tl is None:
            return
        for n in names:
            if begin:
                tl.begin(n, activity)
            else:
                tl.end(n)

    # ------------------------------------------------------------------ allreduce
    def _reduction(self, req: Any, group: Group) -> Reduction:
        op = work_op(req.reduce_op)
        post, div = post_factors(req.reduce_op, req.postscale, group.size)
        work, dtype, widen = self._dtypes(req.dtype)
        exact = dtype.kind == "f" and op == ReduceOp.SUM and power_of_two(post / div)
        return Reduction(op, req.prescale, post, div, work, widen, exact)

    def _allreduce(self, batch: Sequence[Response], entries: Sequence[Any], group: Group,
                   tl: Timeline | None) -> None:
        """Reduce a batch piece by piece, each piece scaled and copied while it is hot in cache.

        ``plan.plan_reduction`` cuts the batch into transport calls from the agreed sizes alone;
        ``placement`` picks, on this rank, whether each call is reduced in the tensors' memory or
        through the huge-page fusion buffer; ``buffers.run_reduction`` carries it out. A response
        whose tensors every rank holds end to end (``Request.flat``) is planned as one item of
        their total size (the raw schedule of a flat buffer); a rank whose memory is not one span
        gathers those pieces through the buffer: the same transport calls.
        """
        req = batch[0].request
        red = self._reduction(req, group)
        chunk = self.chunk_bytes
        items, starts = batch_items(batch, entries, self._ops)
        sizes: list[int] = []
        groups: dict[int, tuple[int, list[int]]] = {}
        index: list[int] = []
        placement = self.placement
        placement.owners.clear()
        if not (chunk > 0 and any(r.request.flat for r in batch)):
            sizes = [it.n for it in items]
        else:
            starts.append(len(items))
            spans: list[Item] = []
            for r, resp in enumerate(batch):
                first, stop = starts[r], starts[r + 1]
                mine = items[first:stop]
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
            items = spans
        calls = self._plan_reduction(sizes, red.work.itemsize, chunk, self.max_tensor_bytes,
                                     self.fusion_enabled, red.widen)
        activity = None
        if tl is not None:
            def activity(names: Sequence[str], name: str, begin: bool) -> None:
                self._activity(tl, names, name, begin)
        run_reduction(calls, items, self._ops, red, self._reducer(group, red.op), placement, activity,
                      self._act + "ALLREDUCE", index if groups else None, groups)

    def _reducer(self, group: Group, op: ReduceOp) -> Callable[[np.ndarray], None]:
        """In-place reduction of a flat buffer over ``group``: flat, or hierarchical when enabled."""
        backend = self.backend
        if self.hierarchical_allreduce:
            hier = self._hierarchy(group)
            if hier is not None:
                return lambda buf: hier.allreduce(buf, op)
        return lambda buf: backend.allreduce(buf, op, group)

    def _hierarchy(self, group: Group) -> Hierarchy | None:
        """The set's local and cross groups, made on first use (by all of the set's members, which
        run the same batch); None when the hierarchy does not apply (see ``hierarchy.host_layout``)."""
        key = tuple(group.ranks)
        if key in self._hierarchies:
            cached = self._hierarchies[key]
            if cached is None or cached.group is group:
                return cached
        layout = None
        if self.hostnames is not None and hasattr(self.backend, "split_group"):
            layout = host_layout(group.ranks, self.hostnames)
        hier = Hierarchy(self.backend, group, *layout) if layout is not None else None
        self._hierarchies[key] = hier
        return hier

    # ------------------------------------------------------------------ broadcast
    def _broadcast(self, batch: Sequence[Response], entries: Sequence[Any], group: Group,
                   tl: Timeline | None) -> None:
        req = batch[0].request
        root = group.ranks.index(req.root_rank)
        is_root = group.rank == root
        pairs: list[tuple[np.ndarray, np.ndarray]] = []
        for entry in entries:
            if entry.outputs is None:
                entry.outputs = [x if is_root else self._outputs.empty(x.shape, x.dtype) for x in entry.inputs]
            for x, o in zip(entry.inputs, entry.outputs):
                pairs.append((_move_view(x), _move_view(o)))
        names = [r.name for r in batch] if tl is not None else []
        # The same plan as a reduction's, unchunked, in bytes: tensors above max_tensor_bytes alone,
        # the others fused into one call.
        calls = self._plan_reduction([x.nbytes for x, _ in pairs], 1, 0, self.max_tensor_bytes,
                                     self.fusion_enabled)
        for call in calls:
            segs = call.segments
            if call.kind == PACKED and len(segs) > 1:
                fbuf = self._ops.buffer(np.dtype(np.uint8), call.size)
                if is_root:
                    for i, _s, _e, off in segs:
                        x = pairs[i][0]
                        fbuf[off:off + x.nbytes] = x.view(np.uint8)
                self._activity(tl, names, self._act + "BCAST", True)
                self.backend.broadcast(fbuf, root, group)
                self._activity(tl, names, self._act + "BCAST", False)
                if not is_root:
                    for i, _s, _e, off in segs:
                        o = pairs[i][1]
                        o.view(np.uint8)[:] = fbuf[off:off + o.nbytes]
                continue
            x, o = pairs[segs[0][0]]
            if is_root and not np.shares_memory(o, x):
                np.copyto(o, x)
            self.backend.broadcast(o, root, group)

    # ------------------------------------------------------------------ allgather
    def _allgather(self, entry: Any, group: Group, tl: Timeline | None) -> None:
        dims = np.array([x.shape[0] for x in entry.inputs], np.int64)
        all_dims = self.backend.allgather_ints(dims, group)
        outputs = []
        for i, x in enumerate(entry.inputs):
            row = int(np.prod(x.shape[1:]))
            counts = [int(c) * row for c in all_dims[:, i]]
            out = aligned_empty((int(all_dims[:, i].sum()),) + x.shape[1:], x.dtype)
            hier = self._hierarchy(group) if self.hierarchical_allgather else None
            if hier is not None:
                hier.allgatherv(_move_view(x), _move_view(out), counts)
            else:
                self.backend.allgatherv(_move_view(x), _move_view(out), counts, group)
            outputs.append(out)
        entry.outputs = outputs

    # ------------------------------------------------------------------ alltoall
    def _alltoall(self, entry: Any, group: Group, tl: Timeline | None) -> None:
        x = entry.inputs[0]
        splits = entry.splits
        recv_splits = self.backend.alltoall_ints(splits, group)
        row = int(np.prod(x.shape[1:]))
        out = aligned_empty((int(recv_splits.sum()),) + x.shape[1:], x.dtype)
        self.backend.alltoallv(_move_view(x), [int(s) * row for s in splits], _move_view(out),
                               [int(s) * row for s in recv_splits], group)
        entry.outputs = [(out, recv_splits.astype(np.int32))]

    # ------------------------------------------------------------------ reducescatter
    def _reducescatter(self, entry: Any, group: Group, tl: Timeline | None) -> None:
        req = entry.request
        op = work_op(req.reduce_op)
        post, div = post_factors(req.reduce_op, req.postscale, group.size)
        outputs = []
        for x in entry.inputs:
            work = self._work_dtype(x.dtype.name)
            send = x.reshape(-1)
            if work != x.dtype:  # float16 widened to float32: scaled in float32
                send = send.astype(work)
                if req.prescale != 1.0:
                    send *= req.prescale
            elif req.prescale != 1.0:  # integers are scaled in float64 and truncated, as upstream
                scaled = np.empty(send.size, work)
                scale_array(scaled, send, req.prescale)
                send = scaled
            rows = reducescatter_rows(x.shape[0], group.size)
            row = int(np.prod(x.shape[1:]))
            recv = aligned_empty((rows[group.rank],) + x.shape[1:], work)
            self.backend.reducescatter(np.ascontiguousarray(send), recv.reshape(-1),
                                       [r * row for r in rows], op, group)
            if work != x.dtype or post != 1.0 or div != 1:
                out = aligned_empty(recv.shape, x.dtype)
                scale_array(out, recv, post, div)
                recv = out
            outputs.append(recv)
        entry.outputs = outputs
