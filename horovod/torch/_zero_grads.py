"""Stage 2's gradient reduction for ``ZeroRedundancyOptimizer``: each rank receives only the
averaged gradients of the parameters it owns.

The parameters are cut into buckets (one dtype each, at most ``bucket_bytes``, in reverse order
of the parameters, the order in which backward produces their gradients). With the alltoall
schedule, a hook on every parameter copies its gradient into its bucket's send buffer as soon as
autograd has accumulated it, and releases the gradient right away (``p.grad = None``): from then
on the bucket holds it.
The send buffer is laid out by owner (rank 0's parameters first), so one ``alltoall`` with those
splits hands each owner every rank's copy of its parameters' gradients; the owner sums them
locally. That is a reduce-scatter: each rank sends (N-1)/N of the bucket, as in a ring
reduce-scatter, and receives as much. It is done as an alltoall plus a local sum because Open
MPI's ``MPI_Reduce_scatter`` ran 2-3x slower than both that and an allreduce of the same buffer
on shared memory on a quiet 2-core machine (``benchmarks/zero_memory.py`` times the schedules).

Schedule ``"auto"`` (the default) also tries the other schedule: the bucket's gradients averaged
in place by one grouped allreduce, as ``DistributedOptimizer`` does (no copy into a bucket; twice
the bytes on the wire, through the engine's chunked allreduce path), after which each rank keeps
its own parameters' gradients and releases the others. The first flush of each is a warm-up,
the second is timed (the slowest rank's time, agreed by the allreduce that follows every flush),
and the faster one is kept, the same on every rank. ``"alltoall"`` or ``"allreduce"`` fixes it.

A bucket whose gradients are all in starts at once when the engine overlaps gradient reductions
with backward (``tunables.overlap``); otherwise it waits for the end of the backward pass. The
pass's last autograd callback (as ``DenseReducer``'s) runs the reduction: it submits the buckets
the pass left incomplete (zeros for the gradients that never came, so every rank submits the same
names) and waits for all, so ``backward()`` returns with the owner's averaged gradients, views of
the summed row, and ``GradScaler``/clipping need no ``synchronize()``. ``synchronize()`` does the
same for a rank whose pass produced no gradient (or outside autograd). ``ShardedGradients`` is a
``GradientReducer`` (``horovod/torch/reducer.py``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from horovod.common.process_sets import ProcessSet
from horovod.common.types import Average, Max
from horovod.torch._autograd import GradHooks, at_end_of_backward
from horovod.torch._clip import clip_by_global_norm
from horovod.torch._finite import all_finite
from horovod.torch.mpi_ops import allreduce_, alltoall_async, grouped_allreduce_async_, synchronize
from horovod.torch.reducer import PassesPerStep, SkipSynchronize

__all__ = ["ShardedGradients", "MANY_PASSES", "SCHEDULES"]

SCHEDULES = ("auto", "alltoall", "allreduce")
# flush k of schedule "auto" (k from 0): which schedule it uses, and whether it is timed
_TRIAL = (("alltoall", False), ("alltoall", True), ("allreduce", False), ("allreduce", True))

MANY_PASSES = ("ZeroRedundancyOptimizer(stage=2): the gradient of {name!r} was computed more than "
               "backward_passes_per_step={passes} times before step() or synchronize(); its bucket "
               "was already sent. Set backward_passes_per_step to the number of backward passes "
               "per step.")
_BUSY = ("ZeroRedundancyOptimizer(stage=2).zero_grad() was called after backward() but before "
         "step() or synchronize(): the gradients of this step are packed for their reduction "
         "(released from p.grad). Call step() or synchronize() first.")


class _Bucket:
    """Parameters of one dtype reduced by one alltoall: ``send`` lists (index, offset, numel) in
    the send buffer, grouped by owner; ``mine`` the owned ones' (index, offset in the received row,
    numel)."""

    __slots__ = ("name", "dtype", "send", "splits", "mine", "mine_len", "numel", "offset",
                 "waiting", "buf", "handle", "ctx", "kind")

    def __init__(self, name: str, members: list[int], params: list[torch.Tensor], owner: list[int],
                 rank: int, world: int) -> None:
        self.name = name
        self.dtype = params[members[0]].dtype
        self.send: list[tuple[int, int, int]] = []
        self.splits = [0] * world
        self.offset: dict[int, int] = {}
        pos = 0
        for r in range(world):
            for i in members:
                if owner[i] == r:
                    n = params[i].numel()
                    self.send.append((i, pos, n))
                    self.offset[i] = pos
                    self.splits[r] += n
                    pos += n
        self.numel = pos
        start = sum(self.splits[:rank])
        self.mine = [(i, off - start, n) for i, off, n in self.send if owner[i] == rank]
        self.mine_len = self.splits[rank]
        self.waiting = len(members)
        self.buf: torch.Tensor | None = None
        self.handle: Any = None
        self.ctx: Any = None
        self.kind = ""  # the schedule of the reduction in flight


def _buckets(params: list[torch.Tensor], owner: list[int], rank: int, world: int,
             bucket_bytes: int) -> list[_Bucket]:
    """Cut the parameters, last first, into buckets of one dtype and at most ``bucket_bytes``
    (a larger parameter has a bucket of its own); the same on every rank."""
    open_: dict[torch.dtype, list[int]] = {}
    size: dict[torch.dtype, int] = {}
    groups: list[list[int]] = []
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        members = open_.get(p.dtype)
        if members is not None and size[p.dtype] + nbytes > bucket_bytes:
            groups.append(members)
            members = None
        if members is None:
            members = open_[p.dtype] = []
            size[p.dtype] = 0
        members.append(i)
        size[p.dtype] += nbytes
    groups += [m for m in open_.values() if m]
    return [_Bucket(f"zero.grads.{k}", m, params, owner, rank, world) for k, m in enumerate(groups)]


class ShardedGradients(PassesPerStep, SkipSynchronize):
    """The hooks, buckets and reduction of stage 2 (see the module docstring): a
    ``GradientReducer`` (``horovod/torch/reducer.py``). ``configure`` re-partitions it."""

    def __init__(self, params: list[torch.Tensor], names: list[str], owner: list[int], rank: int,
                 world: int, bucket_bytes: int, process_set: ProcessSet, op: int,
                 scale: tuple[float, float], compression: Any, passes: int,
                 schedule: str = "auto") -> None:
        self.params, self.names = params, names
        self.process_set = process_set
        self.op, self.scale, self.compression = op, scale, compression
        self._passes = passes
        self._hooks = GradHooks()
        # End of backward (as ``DenseReducer``): the pass that takes the step's gradients reduces
        # them before ``backward()`` returns, so ``GradScaler.unscale_`` and clipping see them.
        self._armed = False
        self._auto_synced = False
        self.configure(owner, rank, world, bucket_bytes, schedule)

    def configure(self, owner: list[int], rank: int, world: int, bucket_bytes: int,
                  schedule: str) -> None:
        """(Re)build the buckets for a partition (``owner`` of each parameter) and hook the
        parameters when there is more than one rank; the schedule trial starts again."""
        self.remove_hooks()
        self.owner, self.rank, self.world = owner, rank, world
        params, passes = self.params, self.backward_passes_per_step
        self.buckets = _buckets(params, owner, rank, world, bucket_bytes)
        self._bucket_of = {i: b for b in self.buckets for i, _, _ in b.send}
        self._delay = [passes] * len(params)
        self._packed = [False] * len(params)
        self._busy = False
        self._armed = self._auto_synced = False
        # A rank that owns no parameter keeps one zero gradient (on the smallest parameter) so
        # that GradScaler has a gradient to check on every rank (see ``_agree_finite``).
        self._sentinel = None
        if rank not in owner and params:
            self._sentinel = min(range(len(params)), key=lambda i: (params[i].numel(), i))
        self.schedule = schedule
        self._flushes = 0  # of schedule "auto" (see _TRIAL)
        self._trial: dict[str, float] = {}
        self.current = "alltoall" if schedule == "auto" else schedule
        if world > 1:
            self.register_hooks()

    @property
    def trial_times(self) -> dict[str, float]:
        """Schedule ``"auto"``: the timed flush of each schedule tried so far (seconds)."""
        return dict(self._trial)

    # ------------------------------------------------------------------ hooks
    def register_hooks(self) -> None:
        """A gradient hook on every parameter that requires a gradient."""
        for i, p in enumerate(self.params):
            if p.requires_grad:
                self._hooks.add(p, self._make_hook(i))

    def remove_hooks(self) -> None:
        self._hooks.remove()

    def _make_hook(self, i: int) -> Any:
        def hook(p: torch.Tensor) -> None:
            if self._auto_synced:
                # Another pass after one that reduced the step's gradients (several losses per
                # step): reduced again at its end, adding to the averages (as DenseReducer).
                self._auto_synced = False
            delay = self._delay[i]
            if delay > 1:
                self._delay[i] = delay - 1  # accumulating locally in p.grad
                return
            if self._packed[i]:
                raise AssertionError(MANY_PASSES.format(name=self.names[i],
                                                        passes=self.backward_passes_per_step))
            if not self._armed:
                self._arm()
            bucket = self._bucket_of[i]
            if self.current == "alltoall":
                self._pack(bucket, i, p)
            else:  # reduced in place: only counted
                self._busy = self._packed[i] = True
                bucket.waiting -= 1
            if bucket.waiting == 0 and self._overlap():
                self._submit(bucket)
        return hook

    def _arm(self) -> None:
        """Queue ``_end_of_backward`` for the running backward pass (once per pass)."""
        self._armed = at_end_of_backward(self._end_of_backward)  # outside one: synchronize() reduces

    def _end_of_backward(self) -> None:
        """Autograd's last callback of a pass that took gradients for this step: reduce them
        all (zeros for those that did not come), so that ``backward()`` returns with this rank's
        averaged gradients. A rank whose pass produced no gradient reduces in ``synchronize()``."""
        self._armed = False
        self._reduce()
        self._auto_synced = True

    def _overlap(self) -> bool:
        from horovod.common.context import peek_context

        ctx = peek_context()
        engine = getattr(ctx, "engine", None)
        return engine is None or bool(engine.tunables.overlap)

    def _pack(self, bucket: _Bucket, i: int, p: torch.Tensor) -> None:
        """Copy ``p``'s gradient (zeros if it has none) into its bucket and release it."""
        self._busy = True
        if bucket.buf is None:
            bucket.buf = torch.empty(bucket.numel, dtype=bucket.dtype, device=p.device)
        off, n = bucket.offset[i], p.numel()
        g = p.grad
        if g is None:
            bucket.buf[off:off + n].zero_()
        else:
            if g.is_sparse:
                g = g.to_dense()
            bucket.buf[off:off + n].copy_(g.reshape(-1))
            p.grad = None
        self._packed[i] = True
        bucket.waiting -= 1

    def _submit(self, bucket: _Bucket) -> None:
        if self.current == "allreduce":
            self._submit_allreduce(bucket)
            return
        for i, _, _ in bucket.send:
            if not self._packed[i]:
                self._pack(bucket, i, self.params[i])
        buf = bucket.buf
        assert buf is not None
        pre = self.scale[0]
        if pre != 1.0:
            buf.mul_(pre)
        compressed, bucket.ctx = self.compression.compress(buf)
        bucket.handle = alltoall_async(compressed, splits=bucket.splits, name=bucket.name,
                                       process_set=self.process_set)
        bucket.buf, bucket.kind = None, "alltoall"

    def _submit_allreduce(self, bucket: _Bucket) -> None:
        """The bucket's gradients averaged in place, as ``DistributedOptimizer`` does (one
        grouped allreduce, fused by the engine); zeros for those that did not come."""
        tensors, ctxs = [], []
        for i, _, _ in bucket.send:
            p = self.params[i]
            g = p.grad
            if g is None or g.is_sparse:
                p.grad = g = torch.zeros_like(p) if g is None else g.to_dense()
            self._packed[i] = True
            compressed, ctx = self.compression.compress(g)
            tensors.append(compressed)
            ctxs.append(ctx)
        self._busy = True
        bucket.ctx, bucket.kind = ctxs, "allreduce"
        bucket.handle = grouped_allreduce_async_(
            tensors, name=bucket.name + ".ar", op=self.op, prescale_factor=self.scale[0],
            postscale_factor=self.scale[1], process_set=self.process_set)

    # ------------------------------------------------------------------ reduction
    def synchronize(self) -> None:
        """Submit what backward left, wait for every bucket and give each owned parameter its
        averaged gradient; then agree on non-finite gradients (``_agree_finite``). Buckets that
        backward did not start go two at a time, so that at most two buckets' received buffers
        exist at once. Nothing to do after a backward pass that reduced them at its end."""
        if self._auto_synced:
            self._auto_synced = False
            return
        self._reduce()

    def _reduce(self) -> None:
        t0 = time.perf_counter()
        finite, previous = True, None
        for bucket in self.buckets:  # submit one, finish the one before (two in flight)
            if bucket.handle is None:
                self._submit(bucket)
            if previous is not None:
                finite = self._finish(previous) and finite
            previous = bucket
        if previous is not None:
            finite = self._finish(previous) and finite
        self.reset()
        slowest = self._agree_finite(finite, time.perf_counter() - t0)
        if self.schedule == "auto" and self._flushes < len(_TRIAL):
            name, timed = _TRIAL[self._flushes]
            if timed:
                self._trial[name] = slowest
            self._flushes += 1
            self.current = (_TRIAL[self._flushes][0] if self._flushes < len(_TRIAL)
                             else min(self._trial, key=lambda k: (self._trial[k], k)))

    def _finish(self, bucket: _Bucket) -> bool:
        out = synchronize(bucket.handle)
        ctx, bucket.handle, bucket.ctx = bucket.ctx, None, None
        if bucket.kind == "allreduce":
            return self._finish_allreduce(bucket, out, ctx)
        out = self.compression.decompress(out[0], ctx)
        if not bucket.mine_len:
            return True
        wide = torch.float32 if bucket.dtype in (torch.float16, torch.bfloat16) else None
        rows = out.view(self.world, bucket.mine_len)
        total = rows.sum(0, dtype=wide) if wide is not None else rows.sum(0)
        post = self.scale[1] / self.world if self.op == Average else self.scale[1]
        if post != 1.0:
            total.mul_(post)
        if wide is not None:
            total = total.to(bucket.dtype)
        for i, off, n in bucket.mine:
            p = self.params[i]
            if p.requires_grad:
                p.grad = total[off:off + n].view_as(p)
        return all_finite([total])

    def _finish_allreduce(self, bucket: _Bucket, outputs: Any, ctxs: list[Any]) -> bool:
        """Keep the averaged gradients of this rank's parameters, release the others."""
        kept: list[torch.Tensor] = []
        for (i, _, _), out, ctx in zip(bucket.send, outputs, ctxs):
            p = self.params[i]
            g = p.grad
            assert g is not None
            if self.owner[i] != self.rank or not p.requires_grad:
                p.grad = None
                continue
            result = self.compression.decompress(out, ctx)
            if result is not g:
                g.copy_(result)
            kept.append(g)
        return all_finite(kept)

    def _agree_finite(self, finite: bool, elapsed: float) -> float:
        """One 2-element allreduce (Max): if any rank's averaged gradients are not finite, make one
        of this rank's gradients infinite as well, so that ``GradScaler`` skips the step on every
        rank alike (each rank sees only its own parameters' gradients). Returns the slowest
        rank's ``elapsed``."""
        if self._sentinel is not None:
            p = self.params[self._sentinel]
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        flag = torch.tensor([0.0 if finite else 1.0, elapsed], dtype=torch.float64)
        allreduce_(flag, name="zero.nonfinite", op=Max, process_set=self.process_set)
        if flag[0].item() and finite:
            for p in self.params:
                g = p.grad
                if g is not None and g.numel():
                    g.view(-1)[0] = float("inf")
                    break
        return float(flag[1])

    def reset(self) -> None:
        """Forget this step's packing and pass counts (after the reduction, or to drop it)."""
        self._auto_synced = False
        passes = self.backward_passes_per_step
        self._delay = [passes] * len(self.params)
        self._packed = [False] * len(self.params)
        for bucket in self.buckets:
            bucket.waiting = len(bucket.send)
            bucket.buf = bucket.handle = bucket.ctx = None
        self._busy = False

    def pending(self) -> bool:
        """Whether this step's gradients are packed for a reduction that has not finished."""
        return self._busy

    def check_idle(self) -> None:
        """Raise if this step's gradients are packed for a reduction that has not finished;
        otherwise forget a reduction whose step was skipped (a GradScaler that found inf/NaN)."""
        if self._busy:
            raise AssertionError(_BUSY)
        self._auto_synced = False

    def state_dict(self) -> dict[str, Any]:
        """Nothing of its own to checkpoint (the partition follows from the parameters)."""
        return {}

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip by the norm of the whole averaged gradient: each rank the norm of the gradients it
        owns, combined by one allreduce; finishes reductions in flight first."""
        if self.pending():
            self.synchronize()
        mine = [p.grad for i, p in enumerate(self.params) if self.owner[i] == self.rank and p.grad is not None]
        every = [p.grad for p in self.params if p.grad is not None]
        return clip_by_global_norm(mine, every, max_norm, norm_type, self.process_set, "zero",
                                   error_if_nonfinite)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def _passes_changed(self, passes: int) -> None:
        self._delay = [passes] * len(self.params)
