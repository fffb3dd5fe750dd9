"""Run planned batches of responses on the data transport and fill in each entry's outputs.

Called only from the engine thread. Reductions run piece by piece (``Tunables.chunk_bytes``): the
whole pieces of large tensors are reduced one by one, in the tensor's own memory when that memory
is on huge pages (``pages``), else copied through a reusable huge-page buffer; small tensors and
the tails of large ones are packed together into the fusion buffer, a piece at a time, and the
packed run is reduced before the next large tensor's pieces. Tensors that lie end to end in one
buffer (views of a flattened gradient set) make each packed run one span of memory, which is
reduced where it lies instead of through the buffer. The pieces follow from the agreed shapes
alone, so every rank makes the same transport calls, whichever memory it reduces them in.
Dtypes the transport cannot reduce (float16) are widened to float32 for the reduction. For data
movement (allgather, broadcast, alltoall) any dtype, bool included, travels as unsigned integers of
the same width.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from horovod.common.backends.base import Group
from horovod.common.engine.adasum import AdasumRunner
from horovod.common.engine.device import Planes, is_plane
from horovod.common.engine.hierarchy import Hierarchy, host_layout
from horovod.common.engine.outputs import OutputPool
from horovod.common.engine.pages import huge_page_backed
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


def _span(items: Sequence[tuple[np.ndarray, np.ndarray, bool, str]]) -> np.ndarray | None:
    """One in-place view over the items' memory if they are in place and lie end to end, else None."""
    outs = [o for _x, o, inplace, _name in items if inplace]
    if len(outs) < len(items) or not end_to_end(outs):
        return None
    first = outs[0]
    return np.lib.stride_tricks.as_strided(first, shape=(sum(o.size for o in outs),), strides=(first.itemsize,))


def _pieces(first: int, offsets: list[int], a: int, b: int, at: int) -> list[tuple[int, int, int, int]]:
    """Elements ``[a, b)`` of a span held as separate arrays ``first, first + 1, ...`` (array ``i``
    holds span elements ``offsets[i - first]`` onwards), as (array, start, stop, buffer offset)
    pieces for ``_reduce_packed``, placed from buffer offset ``at``."""
    out = []
    k = bisect.bisect_right(offsets, a) - 1
    while a < b:
        stop = min(b, offsets[k + 1])
        if stop > a:
            out.append((first + k, a - offsets[k], stop - offsets[k], at))
            at += stop - a
            a = stop
        k += 1
    return out


def _move_view(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(_MOVE_DTYPES[a.dtype.itemsize])


def _post_factors(req: Any, group: Group) -> tuple[float, int]:
    """(factor, divisor) applied after the reduction.

    A plain Average divides by the set's size, as the framework's own ``t / size`` does (exactly
    rounded: multiplying float32 by float32(1/3) is one ulp off for about a third of the values);
    an Average with a postscale factor multiplies once by ``postscale / size``.
    """
    if req.reduce_op != ReduceOp.AVERAGE:
        return req.postscale, 1
    if req.postscale == 1.0:
        return 1.0, group.size
    return req.postscale / group.size, 1


def _scale(dst: np.ndarray, src: np.ndarray, factor: float, divisor: int = 1) -> None:
    if divisor != 1:
        if dst.dtype.char == "e":
            np.divide(src, np.float32(divisor), out=dst, dtype=np.float32, casting="unsafe")
        else:
            np.divide(src, divisor, out=dst, casting="unsafe")
    elif factor == 1.0:
        if dst is not src:
            np.copyto(dst, src, casting="unsafe")
    elif dst.dtype.char == "e":  # float16 is scaled in float32 math (as upstream on the CPU)
        np.multiply(src, np.float32(factor), out=dst, dtype=np.float32, casting="unsafe")
    else:
        np.multiply(src, factor, out=dst, casting="unsafe")


def _power_of_two(x: float) -> bool:
    m, _ = math.frexp(x)
    return m == 0.5


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
        self._buffers: dict[tuple[str, int], np.ndarray] = {}
        self._work: dict[str, np.dtype] = {}
        self._dtype_info: dict[str, tuple[np.dtype, np.dtype, bool]] = {}
        self._act = backend.name.upper() + "_"
        self.planes = Planes(self)
        self._hierarchies: dict[tuple[int, ...], Hierarchy | None] = {}
        self._outputs = OutputPool()  # out-of-place allreduce/broadcast results, recycled warm
        self._span_owner: dict[int, np.ndarray] = {}  # id(span of a flat group) -> its first array

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
    def _fusion_buffer(self, dtype: np.dtype, n: int, slot: int = 0) -> np.ndarray:
        key = (dtype.str, slot)
        buf = self._buffers.get(key)
        if buf is None or buf.size < n:
            buf = huge_page_empty(max(n, 1024) * dtype.itemsize).view(dtype)
            self._buffers[key] = buf
        return buf[:n]

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
    def _allreduce(self, batch: Sequence[Response], entries: Sequence[Any], group: Group,
                   tl: Timeline | None) -> None:
        """Reduce a batch piece by piece, each piece scaled and copied while it is hot in cache.

        Tensors of at least ``chunk_bytes`` (or above ``max_tensor_bytes``) are cut into whole
        pieces, each reduced alone: in the tensor's own memory when it is on huge pages or larger
        than ``max_tensor_bytes``, else copied through a second huge-page buffer (a local choice:
        the transport call is the same). Small tensors and the short tails of large ones fill the
        packed buffer of ``chunk_bytes``, reduced when it is full and before the next large
        tensor's pieces (so that views of one flat buffer form runs that are reduced in place,
        see ``_reduce_packed``). Every rank derives the same
        pieces from the agreed shapes, so the transport calls pair up. With ``chunk_bytes`` 0,
        tensors of at most ``max_tensor_bytes`` share one packed call and larger ones get one each.
        """
        req = batch[0].request
        op = ReduceOp.SUM if req.reduce_op == ReduceOp.AVERAGE else req.reduce_op
        post, div = _post_factors(req, group)
        pre = req.prescale
        work, dtype, widen = self._dtypes(req.dtype)
        chunk = self.chunk_bytes // work.itemsize if self.chunk_bytes > 0 else 0
        # (input, output, in_place, name) of flat views.
        items: list[tuple[np.ndarray, np.ndarray, bool, str]] = []
        # A response whose tensors every rank holds end to end (``Request.flat``) is reduced as one
        # span of their total size: first item -> item count where this rank's memory is not one
        # span (its pieces are gathered through the buffer: the same transport calls).
        virtual: dict[int, int] = {}
        self._span_owner.clear()
        for resp, entry in zip(batch, entries):
            first = len(items)
            if entry is None:  # this rank joined: contribute zeros of the agreed shapes
                for shape in resp.request.shapes:
                    z = np.zeros(int(np.prod(shape)), dtype)
                    items.append((z, z, True, resp.name))
            else:
                if entry.outputs is None:
                    entry.outputs = [self._outputs.empty(x.shape, x.dtype) for x in entry.inputs]
                for x, o in zip(entry.inputs, entry.outputs):
                    items.append((x.reshape(-1), o.reshape(-1), o is x, resp.name))
            if resp.request.flat and chunk > 0 and len(items) - first > 1:
                span = _span(items[first:])
                if span is None:
                    virtual[first] = len(items) - first
                else:
                    self._span_owner[id(span)] = items[first][1]
                    items[first:] = [(span, span, True, resp.name)]
        reduce = self._reducer(group, op)
        fuse = self.fusion_enabled
        cut = self.max_tensor_bytes
        if chunk > 0:
            cap = chunk
        else:  # one call for all packed tensors, one per large tensor
            cap = sum(x.size for x, *_ in items if widen or (fuse and x.nbytes <= cut))
        cap = max(cap, 1)
        exact_post = dtype.kind == "f" and op == ReduceOp.SUM and _power_of_two(post / div)
        pack: list[tuple[int, int, int, int]] = []  # (item, start, stop, offset in the buffer)
        fill = 0
        idx = 0
        while idx < len(items):
            x, o, inplace, name = items[idx]
            count = virtual.get(idx, 1) if virtual else 1
            if count > 1:  # one span, spread over several arrays on this rank
                offsets = np.cumsum([0] + [items[i][0].size for i in range(idx, idx + count)]).tolist()
                n = offsets[-1]
            else:
                n = x.size
            nbytes = n * x.itemsize
            start = 0
            if chunk > 0:
                # Whole pieces of large tensors go alone: the same transport calls on every rank,
                # whichever memory each rank reduces them in. A short tail joins the packed buffer.
                if not fuse:
                    stop = n
                elif n >= chunk or nbytes > cut:
                    stop = n - n % chunk if n % chunk and (n % chunk) * x.itemsize <= cut else n
                else:
                    stop = 0
                step = chunk
            elif not widen and not (fuse and nbytes <= cut):
                stop = step = max(n, 1)  # one call per large tensor, in its own memory
            else:
                stop = step = 0
            if stop > 0:
                if chunk > 0 and pack:
                    # The packed run ends where a large tensor's pieces begin: gradients that sit
                    # side by side in one buffer (views of a flat allocation) then form runs that
                    # are contiguous in memory and are reduced where they lie (_reduce_packed).
                    self._reduce_packed(items, pack, fill, work, widen, pre, post, div, reduce, tl)
                    pack, fill = [], 0
                if count > 1:  # each piece gathered from its arrays into the buffer
                    for s in range(0, stop, step):
                        e = min(s + step, stop)
                        self._reduce_packed(items, _pieces(idx, offsets, s, e, 0), e - s, work, widen, pre,
                                            post, div, reduce, tl, slot=1)
                elif chunk > 0 and (widen or (nbytes <= cut and not self._in_own_memory(o))):
                    # Copied piece by piece through the huge-page buffer.
                    for s in range(0, stop, step):
                        e = min(s + step, stop)
                        self._reduce_packed(items, [(idx, s, e, 0)], e - s, work, widen, pre, post, div,
                                            reduce, tl, slot=1)
                else:
                    self._reduce_own(x[:stop], o[:stop], step, inplace, pre, post, div, exact_post,
                                     reduce, tl, name)
                start = stop
            while start < n:
                take = min(n - start, cap - fill)
                if count > 1:
                    pack.extend(_pieces(idx, offsets, start, start + take, fill))
                else:
                    pack.append((idx, start, start + take, fill))
                fill += take
                start += take
                if fill == cap:
                    self._reduce_packed(items, pack, fill, work, widen, pre, post, div, reduce, tl)
                    pack, fill = [], 0
            idx += count
        if pack:
            self._reduce_packed(items, pack, fill, work, widen, pre, post, div, reduce, tl)

    @staticmethod
    def _own_memory(out: np.ndarray) -> bool:
        """Whether a large tensor's whole pieces are reduced in its own memory rather than copied
        through the huge-page buffer: when the memory the transport works on (the output) is on
        huge pages (see ``pages``). On 4 KiB pages the copy costs less than the transport's walk
        over the pages. A local choice: the transport calls are the same either way."""
        return huge_page_backed(out)

    def _in_own_memory(self, out: np.ndarray) -> bool:
        """``_own_memory`` of ``out``, judged by its first array when ``out`` spans a flat group."""
        return self._own_memory(self._span_owner.get(id(out), out))

    def _reduce_own(self, x: np.ndarray, o: np.ndarray, step: int, inplace: bool, pre: float,
                    post: float, div: int, exact_post: bool, reduce: Callable[[np.ndarray], None],
                    tl: Timeline | None, name: str) -> None:
        """Reduce ``x`` into ``o`` piece by piece in ``o``'s memory, each piece scaled while hot."""
        scaled = post != 1.0 or div != 1
        if tl is not None:
            tl.begin(name, self._act + "ALLREDUCE")
        for s in range(0, x.size, step):
            xs, os_ = x[s:s + step], o[s:s + step]
            if pre != 1.0:
                _scale(os_, xs, pre)
                reduce(os_)
            elif inplace:
                reduce(os_)
            elif scaled and exact_post:
                # Scale during the copy, then reduce in place: one pass instead of two,
                # bit-identical because the factor is a power of two.
                _scale(os_, xs, post, div)
                reduce(os_)
                continue
            else:
                np.copyto(os_, xs)
                reduce(os_)
            if scaled:
                _scale(os_, os_, post, div)
        if tl is not None:
            tl.end(name)

    def _reduce_packed(self, items: Sequence[tuple[np.ndarray, np.ndarray, bool, str]],
                       pack: Sequence[tuple[int, int, int, int]], fill: int, work: np.dtype, widen: bool,
                       pre: float, post: float, div: int, reduce: Callable[[np.ndarray], None],
                       tl: Timeline | None, slot: int = 0) -> None:
        """Copy (prescaled, widened) pieces into the fusion buffer, reduce it, copy them out scaled.

        ``slot`` 1 is a second buffer, for a large tensor's piece while small ones fill slot 0.
        When the pieces already lie end to end in memory (in-place views of one flat buffer, as
        a flattened gradient set is), in huge-page memory, that span is reduced where it lies: the
        same transport call, without the two copies."""
        names = list(dict.fromkeys(items[i][3] for i, *_ in pack)) if tl is not None else []
        if not widen and slot == 0:
            span = self._contiguous_span(items, pack, fill)
            if span is not None:
                self._activity(tl, names, self._act + "ALLREDUCE", True)
                if pre != 1.0:
                    _scale(span, span, pre)
                reduce(span)
                if post != 1.0 or div != 1:
                    _scale(span, span, post, div)
                self._activity(tl, names, self._act + "ALLREDUCE", False)
                return
        buf = self._fusion_buffer(work, fill, slot)
        self._activity(tl, names, "MEMCPY_IN_FUSION_BUFFER", True)
        for i, s, e, b in pack:
            dst, src = buf[b:b + e - s], items[i][0][s:e]
            if widen:  # float16 is widened, then scaled in float32 math (as upstream on the CPU)
                np.copyto(dst, src, casting="unsafe")
                if pre != 1.0:
                    np.multiply(dst, pre, out=dst)
            else:
                _scale(dst, src, pre)
        self._activity(tl, names, "MEMCPY_IN_FUSION_BUFFER", False)
        self._activity(tl, names, self._act + "ALLREDUCE", True)
        reduce(buf)
        self._activity(tl, names, self._act + "ALLREDUCE", False)
        self._activity(tl, names, "MEMCPY_OUT_FUSION_BUFFER", True)
        for i, s, e, b in pack:
            _scale(items[i][1][s:e], buf[b:b + e - s], post, div)
        self._activity(tl, names, "MEMCPY_OUT_FUSION_BUFFER", False)

    def _contiguous_span(self, items: Sequence[tuple[np.ndarray, np.ndarray, bool, str]],
                         pack: Sequence[tuple[int, int, int, int]], fill: int) -> np.ndarray | None:
        """One in-place view over the packed pieces if they lie end to end in huge-page memory,
        else None. A local choice: the transport call is the same either way. Separate tensors
        fail at the second piece, before the (costlier) page check."""
        first = items[pack[0][0]][1]
        size = first.itemsize
        at = first.__array_interface__["data"][0] + pack[0][1] * size
        for i, s, e, _ in pack:
            _x, o, inplace, _name = items[i]
            if not inplace or o.__array_interface__["data"][0] + s * size != at:
                return None
            at += (e - s) * size
        if not self._in_own_memory(first):
            return None
        return np.lib.stride_tricks.as_strided(first[pack[0][1]:], shape=(fill,), strides=(size,))

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
        small = [p for p in pairs if p[0].nbytes <= self.max_tensor_bytes] if (
            self.fusion_enabled and len(pairs) > 1) else []
        if len(small) > 1:
            large = [p for p in pairs if p[0].nbytes > self.max_tensor_bytes]
            total = sum(x.nbytes for x, _ in small)
            fbuf = self._fusion_buffer(np.dtype(np.uint8), total)
            if is_root:
                off = 0
                for x, _ in small:
                    fbuf[off:off + x.nbytes] = x.view(np.uint8)
                    off += x.nbytes
            self._activity(tl, names, self._act + "BCAST", True)
            self.backend.broadcast(fbuf, root, group)
            self._activity(tl, names, self._act + "BCAST", False)
            off = 0
            for x, o in small:
                if not (is_root and o is x):
                    o.view(np.uint8)[:] = fbuf[off:off + x.nbytes]
                off += x.nbytes
        else:
            large = pairs
        for x, o in large:
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
        op = ReduceOp.SUM if req.reduce_op == ReduceOp.AVERAGE else req.reduce_op
        post, div = _post_factors(req, group)
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
                _scale(scaled, send, req.prescale)
                send = scaled
            rows = reducescatter_rows(x.shape[0], group.size)
            row = int(np.prod(x.shape[1:]))
            recv = aligned_empty((rows[group.rank],) + x.shape[1:], work)
            self.backend.reducescatter(np.ascontiguousarray(send), recv.reshape(-1),
                                       [r * row for r in rows], op, group)
            if work != x.dtype or post != 1.0 or div != 1:
                out = aligned_empty(recv.shape, x.dtype)
                _scale(out, recv, post, div)
                recv = out
            outputs.append(recv)
        entry.outputs = outputs
