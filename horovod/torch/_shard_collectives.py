"""The collectives of ``hvd.fully_shard`` and their buffers: a wrapped module's parameters
allgathered into its unsharded tensors (``start_unshard``/``wait_unshard``) and freed again
(``reshard``), its gradients reduce-scattered into the shards' ``.grad`` (``reduce``, then
``complete``), the reduce-scatter's input buffer that the root keeps for every module's reduction,
and the agreement on non-finite gradients that ``GradScaler`` needs.

A group's allgather is one collective over the per-rank segments (``_shard_params.py``): each
parameter's rows padded to its slot; a group's reduce-scatter is one collective over N segments,
segment k holding rank k's rows of every gradient.
"""

from __future__ import annotations

import mmap
from typing import Any

import torch

from horovod.common.types import Max
from horovod.torch import mpi_ops
from horovod.torch._finite import all_finite
from horovod.torch._shard_group import ShardGroup, groups_in
from horovod.torch.compression import Compression

__all__ = ["start_unshard", "wait_unshard", "reshard", "reduce", "complete", "agree_finite", "all_finite",
           "release_freed_memory"]

# glibc's malloc_trim, looked up on first use: [the function] or [None] off glibc
_TRIM: list[Any] = []


def start_unshard(g: ShardGroup) -> None:
    """Start the allgather of ``g``'s shards (nothing if gathered or in flight): one grouped
    allgather of each parameter's slot of the per-rank segment (its rows padded to ``c``), so that
    each parameter arrives whole and contiguous (its first ``numel`` elements) in an output of its
    own, which the unsharded parameter can show without a copy."""
    if g.unsharded or g.gather is not None or not g.params:
        return
    dt = g.mp.param_dtype or g.params[0].dtype
    if g.flat is not None and g.flat.dtype == dt and _views_intact(g, g.flat):
        send = g.flat  # the shards are views of it: no copy
    else:
        send = torch.zeros(g.segment, dtype=dt, device=g.params[0].shard.device)
        for q in g.params:
            if q.local_numel:
                send[q.offset:q.offset + q.local_numel].copy_(q.shard.detach().reshape(-1))
    slots = [send[q.offset:q.offset + q.seg].view(q.chunk_rows, *q.shape[1:]) for q in g.params if q.seg]
    if slots:
        g.gather = mpi_ops.grouped_allgather_async(slots, name=g.name("allgather"), process_set=g.process_set)


def _views_intact(g: ShardGroup, flat: torch.Tensor) -> bool:
    """Whether every shard is still its view of ``flat`` (a user may have replaced ``.data``)."""
    base, size = flat.data_ptr(), flat.element_size()
    return all(q.shard.data_ptr() == base + q.offset * size or not q.local_numel for q in g.params)


def wait_unshard(g: ShardGroup) -> None:
    """Finish ``g``'s allgather (starting it if needed) into its unsharded parameters: each shows
    its allgather output as it is, or, when autograd must find this iteration's saved views of it
    in one storage from forward to backward (``g.keeps_storage()``), a copy in its own storage."""
    if g.unsharded or not g.params:
        g.unsharded = True
        return
    if g.gather is None:
        start_unshard(g)
    if g.gather is None:  # no parameter has an element: nothing to gather
        g.unsharded = True
        return
    outs = iter(mpi_ops.synchronize(g.gather))
    g.gather = None
    own = g.keeps_storage()
    borrowed = g.root().borrowed
    with torch.no_grad():
        for q in g.params:
            if not q.seg:
                continue
            full = next(outs).view(-1)[:q.numel].view(q.shape)
            ptr = full.untyped_storage().data_ptr()
            # an output shared with another parameter (not the engine's way today) is copied:
            # saved views are found by their storage
            mine = not own and ptr not in borrowed
            q.show(full, not mine)
            if mine:
                borrowed[ptr] = (g, q)
    g.unsharded = True


def reshard(g: ShardGroup) -> None:
    """Free ``g``'s unsharded tensors and register its shards again."""
    if g.gather is not None:  # a prefetch nobody used: finish it, drop the result
        mpi_ops.synchronize(g.gather)
        g.gather = None
    freed = False
    borrowed = g.root().borrowed
    for q in g.params:
        freed = freed or q.allocated()
        if q.borrowed:
            borrowed.pop(q.unsharded.untyped_storage().data_ptr(), None)
        q.free()
        q.use(q.shard)  # never leave a freed tensor registered (a recompute stopped early)
    g.unsharded = False
    if freed:
        release_freed_memory(g)


def release_freed_memory(g: ShardGroup) -> None:
    """Hand the memory the C allocator holds free back to the kernel (glibc's ``malloc_trim(0)``),
    after ``g``'s unsharded parameters (and, in backward, its gradients) were freed: on CPU,
    unless ``g.release_memory`` is off or the C library is not glibc.

    Why: glibc raises its mmap threshold to the largest block freed so far (up to 32 MiB), so from
    the first freed block on, each module's unsharded parameters, gradients and the allgather's
    output are carved from the heap; small allocations (activations) split the holes they leave,
    the next block's buffers land elsewhere, and the holes stay resident: a step's peak resident
    memory grew to twice the live tensors (docs/fully_shard.md, "Peak memory"). Trimming when
    that free memory has grown by four modules' buffers within an iteration bounds what is
    resident to the live tensors plus a few modules' buffers. Since the gradients are freed as soon
    as they are reduced (``reduce``) and the collectives' results come from the engine's warm pool,
    the heap hardly grows within an iteration and the release rarely has anything to do (a
    release costs ~3 ms, and every page it hands back is faulted in again when reused:
    docs/fully_shard.md, "Sixth round"). It is a call, not a setting: the process's malloc
    parameters are left as they are."""
    if not g.release_memory or not g.params or g.params[0].shard.device.type != "cpu":
        return
    if not _TRIM:
        _TRIM.append(_malloc_trim())
    if _TRIM[0] is None:
        return
    trim, in_use = _TRIM[0]
    # only when the memory that is resident but not in use (the resident set less what the
    # allocator has handed out) has grown by more than a few modules' buffers since its lowest
    # point in this iteration (since the last release): live tensors growing (the shards'
    # gradients during backward) is not a reason, nor is memory freed before the iteration began,
    # and free memory the next buffers reuse at once is not handed back each time (its pages would
    # be faulted in again)
    root = g.root()
    if not root.release_slack:
        biggest = max(h.n * h.segment * h.params[0].unsharded.element_size()
                      for h in groups_in(root.module) if h.params)
        root.release_slack = 4 * biggest
    idle = _resident_bytes() - in_use()
    root.released_idle = min(root.released_idle, idle)
    if idle - root.released_idle > root.release_slack:
        trim(0)
        root.released_idle = _resident_bytes() - in_use()


def _resident_bytes() -> int:
    with open("/proc/self/statm", "rb") as fh:
        return int(fh.read().split()[1]) * _PAGE


_PAGE = mmap.PAGESIZE


def _malloc_trim() -> tuple[Any, Any] | None:
    """glibc's ``malloc_trim`` and a function giving the bytes its allocator has handed out (in
    every arena, and mapped: ``mallinfo2``; 0 before glibc 2.33), or None off glibc."""
    import ctypes
    import ctypes.util

    class MallInfo2(ctypes.Structure):
        _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = lib.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to release this way
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    info = getattr(lib, "mallinfo2", None)
    if info is None:
        return fn, lambda: 0
    info.argtypes, info.restype = [], MallInfo2

    def in_use() -> int:
        m = info()
        return int(m.uordblks + m.hblkhd)
    return fn, in_use


def reduce(g: ShardGroup) -> None:
    """Reduce-scatter ``g``'s accumulated unsharded gradients (missing ones count as zeros) and
    free its unsharded parameters."""
    g.accumulated.clear()
    dt = g.mp.reduce_dtype or g.mp.param_dtype or g.params[0].dtype
    root = g.root()
    # one reduction in flight (it has overlapped this module's backward): finish it first, so
    # that its input buffer serves this one and a rank holds one module's gradients in flight
    while root.pending:
        complete(*root.pending.pop(0))
    direct = _direct_params(g, dt)
    if direct is not None:
        # each gradient is the reduce-scatter's input as it is (no copy into a buffer): the
        # engine's split of its rows is the shards' (``_direct_params``)
        grads = []
        for q in direct:
            grad = q.unsharded.grad
            if grad is None:  # not used in this backward: zeros, as every rank sends the same list
                grad = torch.zeros(q.shape, dtype=dt, device=q.shard.device)
            grads.append(grad.reshape(q.rows, *q.shape[1:]))
            q.unsharded.grad = None
        for q in g.params:
            q.unsharded.grad = None
        h = mpi_ops.grouped_reducescatter_async(grads, name=g.name("reducescatter"), process_set=g.process_set)
        del grads
        root.pending.append((g, h, direct, None))
        reshard(g)
        return
    whole = _take_buffer(root, g.n * g.segment, dt, g.params[0].shard.device)
    buf = whole[:g.n * g.segment].view(g.n, g.segment)
    for q in g.params:
        # rank k's rows of this gradient go to row k of the buffer, in the parameter's slot,
        # padded with zeros to ``seg``
        dst = buf[:, q.offset:q.offset + q.seg]
        grad = q.unsharded.grad
        if grad is None or not q.seg:  # no gradient, or a parameter of no element (no slot)
            dst.zero_()
            q.unsharded.grad = None
            continue
        flat = grad.reshape(-1)
        k, rest = divmod(flat.numel(), q.seg)  # k ranks' rows in full, then ``rest`` elements
        dst[:k].copy_(flat[:k * q.seg].view(k, q.seg))
        if k < g.n:
            dst[k, :rest].copy_(flat[k * q.seg:])
            dst[k, rest:].zero_()
            dst[k + 1:].zero_()
        q.unsharded.grad = None
    sent, ctx = g.compression.compress(buf)
    h = mpi_ops.reducescatter_async(sent, name=g.name("reducescatter"), process_set=g.process_set)
    del sent
    root.pending.append((g, h, ctx, whole))
    reshard(g)


def _direct_params(g: ShardGroup, dt: torch.dtype) -> list[Any] | None:
    """The parameters whose gradients ``g``'s reduce-scatter takes as they are (one grouped
    reduce-scatter, no copy), or None when the packed buffer is needed: a compression or a reduce
    dtype other than the gradients' (a cast is a copy anyway), or a parameter whose rows the
    engine splits otherwise than the shards (it gives the first ``R % N`` ranks one row more; the
    shards give each rank ``ceil(R/N)`` rows while they last); and on CPU, where the copy costs
    less than the page faults it saves: a gradient kept as the reduce-scatter's input is freed only
    after the next module's gradients are allocated, and glibc cannot put a gradient into the hole
    of a freed one of the same size (torch allocates them aligned, ``posix_memalign``, which asks
    for more than the hole), so each module's gradients would take new pages and leave a hole
    behind: a backward's worth of holes, resident or (released) faulted in again every step. Copied
    into the root's kept buffer and freed at once, each gradient is allocated where the previous
    one was, warm (docs/fully_shard.md, "Sixth round"). The same answer on every rank."""
    if g.direct is None:
        ok = g.compression is Compression.none and g.params[0].shard.device.type != "cpu" and all(
            q.unsharded.dtype == dt and _engine_rows(q.rows, g.n) == _shard_rows(q.rows, g.n)
            for q in g.params if q.seg)
        g.direct = [q for q in g.params if q.seg and q.unsharded.requires_grad] if ok else []
    return g.direct or None


def _engine_rows(rows: int, n: int) -> list[int]:
    base, extra = divmod(rows, n)
    return [base + (1 if k < extra else 0) for k in range(n)]


def _shard_rows(rows: int, n: int) -> list[int]:
    c = -(-rows // n)
    return [max(0, min(rows, (k + 1) * c) - k * c) for k in range(n)]


def _take_buffer(root: ShardGroup, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of at least ``numel`` elements for a reduce-scatter's input: a spare one of
    the root's when one fits, so that the same memory serves every module's reduction (no
    per-block allocation for the allocator to keep)."""
    for i, t in enumerate(root.spare):
        if t.dtype == dtype and t.device == device and t.numel() >= numel:
            return root.spare.pop(i)
    return torch.empty(numel, dtype=dtype, device=device)


def _give_back_buffer(root: ShardGroup, whole: torch.Tensor) -> None:
    """A reduce-scatter's input buffer (``_take_buffer``'s), its collective finished: kept for the
    next module's reduction (one at most, the largest: ``reduce`` finishes the reduction in
    flight before it takes a buffer, so one buffer serves every module of a backward)."""
    root.spare.append(whole)
    root.spare.sort(key=lambda t: -t.numel())
    del root.spare[1:]


def complete(g: ShardGroup, handle: int, ctx: Any, whole: torch.Tensor | None) -> None:
    """Wait for a module's reduce-scatter; add this rank's part to its shards' gradients."""
    if whole is None:  # a grouped reduce-scatter of the gradients themselves: ctx lists them
        outs = dict(zip(map(id, ctx), mpi_ops.synchronize(handle)))
        for q in g.params:
            if not q.shard.requires_grad:
                continue
            got = outs.get(id(q))
            part = (got.view(q.shard.shape).to(q.dtype) if got is not None
                    else torch.zeros(q.shard.shape, dtype=q.dtype, device=q.shard.device))
            if q.shard.grad is None:
                q.shard.grad = part
            else:
                q.shard.grad.add_(part)
        return
    out = g.compression.decompress(mpi_ops.synchronize(handle), ctx).reshape(-1)
    _give_back_buffer(g.root(), whole)
    for q in g.params:
        if not q.shard.requires_grad:
            continue
        part = out[q.offset:q.offset + q.local_numel].view(q.shard.shape).to(q.dtype)
        if q.shard.grad is None:
            q.shard.grad = part
        else:
            q.shard.grad.add_(part)


def agree_finite(root: ShardGroup) -> None:
    """After a backward's reductions (on the root): one 1-element allreduce (Max) so that, if any
    rank's shards received a non-finite averaged gradient, every rank makes one of its own
    gradients infinite too, and ``GradScaler`` skips the step on every rank alike (each rank
    checks only its rows; DistributedOptimizer needs nothing, every rank holding every
    average)."""
    shards = [q.shard for g in groups_in(root.module) for q in g.params]
    if not any(p.requires_grad for p in shards):
        return
    grads = [p.grad for p in shards if p.grad is not None]
    bad = not all_finite(grads)
    flag = torch.tensor([1.0 if bad else 0.0], device=shards[0].device)
    flag = mpi_ops.allreduce(flag, op=Max, name="hvd.fully_shard.nonfinite", process_set=root.process_set)
    if float(flag[0]) and not bad:
        for grad in grads:
            if grad.numel():
                grad.view(-1)[0] = float("inf")
                break
