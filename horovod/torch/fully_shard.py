"""Fully sharded parameters (ZeRO stage 3) in FSDP2's shape: ``hvd.fully_shard(module)``.

::

    for block in model.blocks:
        hvd.fully_shard(block)
    hvd.fully_shard(model)                       # the root: what no block holds
    opt = torch.optim.AdamW(model.parameters())  # this rank's shards
    loss(model(x)).backward()                    # gradients reduce-scattered into the shards
    opt.step()

Each parameter of a wrapped module (those of its subtree that no nested wrapped module manages)
is split by rows (dimension 0; a 0-d parameter counts as one row): with R rows over N ranks,
rank r keeps rows ``[r*c, min(R, (r+1)*c))`` with ``c = ceil(R/N)`` as a plain ``nn.Parameter``
registered under the parameter's own name, so ``named_parameters()`` keeps its names and each
shard its number of dimensions. Just before a wrapped module's forward, its shards (cast to
``mp_policy.param_dtype``) are allgathered in one collective (each parameter's rows padded to ``c``
in a per-rank segment) into unsharded tensors that are swapped in for the forward, and swapped out
after it; with ``reshard_after_forward`` their storage is resized to 0 after the forward and
refilled before the module's backward (autograd's saved references stay valid). The next module is
allgathered ahead (the order of the previous iteration forward, its reverse in backward). When
every gradient of a module has been accumulated, they are reduce-scattered (``op=Average``, in
``mp_policy.reduce_dtype``) in one collective; the end of backward waits for them and adds each
rank's part to its shards' ``.grad``. See docs/fully_shard.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from horovod.common.job_state import next_number
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.common.types import Max, Sum
from horovod.torch import mpi_ops
from horovod.torch._clip import clip_by_global_norm
from horovod.torch.compression import Compression, StatefulCompressor
from horovod.torch.reducer import RowShard, SkipSynchronize

__all__ = ["fully_shard", "FullyShardedModule", "MixedPrecisionPolicy", "clip_grad_norm_",
           "full_optim_state_dict", "load_full_optim_state_dict", "row_shards", "relayout",
           "FullyShardedReducer", "reducer_for", "check_same_modules"]


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed precision: the dtype parameters are gathered and computed in
    (``param_dtype``), the dtype gradients are reduced in (``reduce_dtype``, default
    ``param_dtype``), the dtype of the forward's floating outputs (``output_dtype``), and whether
    floating inputs are cast to ``param_dtype`` (``cast_forward_inputs``). The shards, their
    gradients and the optimizer keep the parameters' own dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


class _Param:
    """One managed parameter: its shard (the registered nn.Parameter) and its unsharded tensor."""

    def __init__(self, fqn: str, owners: list[tuple[torch.nn.Module, str]], full: torch.nn.Parameter,
                 n: int, r: int, compute_dtype: torch.dtype, offset: int) -> None:
        self.fqn, self.owners = fqn, owners
        self.shape = tuple(full.shape)
        self.dtype = full.dtype
        self.rows = self.shape[0] if self.shape else 1
        self.row_numel = math.prod(self.shape[1:]) if self.shape else 1
        self.chunk_rows = -(-self.rows // n)
        self.seg = self.chunk_rows * self.row_numel           # this parameter's slot per rank
        self.offset = offset                                  # the slot's offset in a segment
        lo = min(self.rows, r * self.chunk_rows)
        hi = min(self.rows, (r + 1) * self.chunk_rows)
        self.lo, self.hi = lo, hi
        data = full.detach().reshape(self.rows, *self.shape[1:])[lo:hi].clone()
        self.shard = torch.nn.Parameter(data, requires_grad=full.requires_grad)
        _SHARD_NAMES[self.shard] = fqn
        self.unsharded = torch.nn.Parameter(torch.empty(self.shape, dtype=compute_dtype, device=full.device),
                                            requires_grad=full.requires_grad)
        self.nbytes = self.unsharded.numel() * self.unsharded.element_size()
        self.free()

    @property
    def local_numel(self) -> int:
        return (self.hi - self.lo) * self.row_numel

    def free(self) -> None:
        self.unsharded.data.untyped_storage().resize_(0)

    def allocated(self) -> bool:
        return self.unsharded.data.untyped_storage().size() > 0

    def use(self, which: torch.nn.Parameter) -> None:
        for mod, name in self.owners:
            mod._parameters[name] = which


def _describe(module: torch.nn.Module, params: list[tuple[str, torch.Tensor]]) -> list[Any]:
    return [type(module).__name__] + [(n, tuple(p.shape), str(p.dtype)) for n, p in params]


class _Group:
    """The state of one wrapped module."""

    def __init__(self, module: torch.nn.Module, reshard_after_forward: bool, process_set: ProcessSet,
                 mp: MixedPrecisionPolicy, compression: Any, index: int) -> None:
        self.module, self.process_set, self.mp, self.compression = module, process_set, mp, compression
        self.reshard_after_forward = reshard_after_forward
        self.index = index
        self.n = process_set.size() or 1
        self.r = process_set.rank() or 0
        self.owner: _Group | None = None  # the enclosing wrapped module's group, once wrapped
        self.requires_sync = True
        # iteration state (kept on the root group)
        self.order: list[_Group] = []
        self.prev_order: list[_Group] = []
        self.pending: list[tuple[_Group, int, Any, torch.Tensor]] = []
        self.spare: list[torch.Tensor] = []  # reduce-scatter input buffers, reused (``take_buffer``)
        self.callback_queued = False
        self.in_forward = False
        self.iteration = 0
        self.seq_iteration = -1
        self.seq: dict[str, int] = {}
        # this group's state
        self.gather: int | None = None
        self.unsharded = False
        self.accumulated: set[int] = set()
        self.params: list[_Param] = []
        self.desc: list[Any] = []  # what collect() checks every rank agrees on

    # -------------------------------------------------------------------- setup
    def collect(self) -> None:
        """Take every parameter of the subtree not managed by a nested wrapped module."""
        module = self.module
        owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        first: dict[int, tuple[str, torch.nn.Parameter]] = {}
        for mname, mod in module.named_modules(remove_duplicate=False):
            for pname, p in mod._parameters.items():
                if p is None:
                    continue
                fqn = f"{mname}.{pname}" if mname else pname
                if p in _SHARD_NAMES:
                    # a shard of a nested group: must be registered inside that group's module only
                    inner = _group_of_shard(module, p)
                    if inner is None or not _inside(inner.module, mod):
                        raise ValueError(
                            f"hvd.fully_shard: rank {self.r}: parameter {fqn} of {type(module).__name__} "
                            f"is also a parameter of a nested fully sharded module ({_SHARD_NAMES[p]}); "
                            "a parameter shared between wrapped modules must be wrapped with their "
                            "common ancestor (wrap the outer module only)")
                    continue
                if p in _SHARDED_AS:  # the original of a parameter sharded earlier
                    raise ValueError(
                        f"hvd.fully_shard: rank {self.r}: parameter {fqn} of {type(module).__name__} is "
                        f"tied to {_SHARDED_AS[p]}, which an earlier fully_shard call sharded; a parameter "
                        "shared between modules must be wrapped with their common ancestor (wrap the "
                        "outer module only)")
                owners.setdefault(id(p), []).append((mod, pname))
                first.setdefault(id(p), (fqn, p))
        named = list(first.values())
        # every rank of the set must wrap the same module with the same parameters
        desc = _describe(module, [(n, p) for n, p in named])
        self.desc = desc
        # an elastic worker may join a running job, whose ranks wrapped their modules long ago:
        # the check is made by hvd.elastic.TorchState's sync (check_same_modules), with them
        if os.environ.get("HOROVOD_ELASTIC") != "1":
            everyone = mpi_ops.allgather_object_ps(desc, self.process_set) if hasattr(
                mpi_ops, "allgather_object_ps") else _allgather_object(desc, self.process_set)
            _raise_on_difference([everyone], [self.index])
        dtypes = {p.device.type for _, p in named}
        if len(dtypes) > 1:
            raise ValueError(f"hvd.fully_shard: rank {self.r}: {type(module).__name__} has parameters "
                             f"on different devices {sorted(dtypes)}; move the module to one device first")
        offset = 0
        for fqn, p in named:
            if not p.is_floating_point():
                raise ValueError(f"hvd.fully_shard: rank {self.r}: parameter {fqn} has dtype {p.dtype}; "
                                 "only floating point parameters can be sharded")
            cdt = self.mp.param_dtype or p.dtype
            prm = _Param(fqn, owners[id(p)], p, self.n, self.r, cdt, offset)
            offset += prm.seg
            prm.use(prm.shard)
            _SHARDED_AS[p] = f"{fqn} of {type(module).__name__}"
            self.params.append(prm)
            if prm.unsharded.requires_grad:
                prm.unsharded.register_post_accumulate_grad_hook(self._make_grad_hook(len(self.params) - 1))
        self.segment = offset
        # the shards become views of one flat per-rank segment, the allgather's input as it is
        # (padding included), when they share a dtype
        self.flat: torch.Tensor | None = None
        if self.params and len({q.dtype for q in self.params}) == 1:
            flat = torch.zeros(offset, dtype=self.params[0].dtype, device=self.params[0].shard.device)
            for q in self.params:
                view = flat[q.offset:q.offset + q.local_numel].view(q.shard.shape)
                view.copy_(q.shard.data)
                q.shard.data = view
            self.flat = flat
        self.n_grad = sum(1 for q in self.params if q.unsharded.requires_grad)

    def root(self) -> _Group:
        g = self
        while g.owner is not None:
            g = g.owner
        return g

    def name(self, what: str) -> str:
        """A collective's name, unique while in flight (a module may run twice in an iteration) and
        the same every iteration (the engine's response cache knows it)."""
        it = self.root().iteration
        if self.seq_iteration != it:
            self.seq_iteration, self.seq = it, {}
        k = self.seq.get(what, 0)
        self.seq[what] = k + 1
        return f"hvd.fully_shard.{self.index}.{what}.{k}"

    # -------------------------------------------------------------------- unshard / reshard
    def start_unshard(self) -> None:
        if self.unsharded or self.gather is not None or not self.params:
            return
        dt = self.mp.param_dtype or self.params[0].dtype
        if self.flat is not None and self.flat.dtype == dt and self._views_intact():
            send = self.flat  # the shards are views of it: no copy
        else:
            send = torch.zeros(self.segment, dtype=dt, device=self.params[0].shard.device)
            for q in self.params:
                if q.local_numel:
                    send[q.offset:q.offset + q.local_numel].copy_(q.shard.detach().reshape(-1))
        self.gather = mpi_ops.allgather_async(send, name=self.name("allgather"), process_set=self.process_set)

    def _views_intact(self) -> bool:
        """Whether every shard is still its view of ``flat`` (a user may have replaced ``.data``)."""
        assert self.flat is not None
        base, size = self.flat.data_ptr(), self.flat.element_size()
        return all(q.shard.data_ptr() == base + q.offset * size or not q.local_numel for q in self.params)

    def wait_unshard(self) -> None:
        if self.unsharded or not self.params:
            self.unsharded = True
            return
        if self.gather is None:
            self.start_unshard()
        assert self.gather is not None
        out = mpi_ops.synchronize(self.gather).view(self.n, self.segment)
        self.gather = None
        with torch.no_grad():
            for q in self.params:
                u = q.unsharded.data
                if not q.allocated():
                    u.untyped_storage().resize_(q.nbytes)
                numel = q.rows * q.row_numel
                u.view(-1).copy_(out[:, q.offset:q.offset + q.seg].reshape(-1)[:numel])
        self.unsharded = True

    def swap_in(self) -> None:
        for q in self.params:
            q.use(q.unsharded)

    def swap_out(self) -> None:
        for q in self.params:
            q.use(q.shard)

    def reshard(self) -> None:
        if self.gather is not None:  # a prefetch nobody used: finish it, drop the result
            mpi_ops.synchronize(self.gather)
            self.gather = None
        for q in self.params:
            q.free()
            q.use(q.shard)  # never leave a freed tensor registered (a recompute stopped early)
        self.unsharded = False

    def relayout(self) -> bool:
        """Lay the shards out over the process set's current size and rank (see ``relayout``)."""
        n, r = self.process_set.size() or 1, self.process_set.rank() or 0
        if (n, r) == (self.n, self.r):
            return False
        self.reshard()
        self.n, self.r = n, r
        self.order, self.prev_order, self.pending = [], [], []
        self.callback_queued, self.in_forward = False, False
        self.accumulated.clear()
        offset = 0
        for q in self.params:
            q.chunk_rows = -(-q.rows // n)
            q.seg = q.chunk_rows * q.row_numel
            q.offset = offset
            offset += q.seg
            q.lo, q.hi = min(q.rows, r * q.chunk_rows), min(q.rows, (r + 1) * q.chunk_rows)
            q.shard.grad = None
            q.shard.data = torch.zeros((q.hi - q.lo, *q.shape[1:]), dtype=q.dtype, device=q.shard.device)
        self.segment = offset
        self.flat = None
        if self.params and len({q.dtype for q in self.params}) == 1:
            flat = torch.zeros(offset, dtype=self.params[0].dtype, device=self.params[0].shard.device)
            for q in self.params:
                q.shard.data = flat[q.offset:q.offset + q.local_numel].view(q.shard.shape)
            self.flat = flat
        return True

    # -------------------------------------------------------------------- forward hooks
    def pre_forward(self, module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        root = self.root()
        if root is self:
            if root.pending or root.callback_queued:  # a backward that did not finish its callback
                root.finish_backward()
            root.prev_order, root.order = (root.order or root.prev_order), []
            root.iteration += 1
            root.in_forward = True
        recompute = root.callback_queued and root is not self  # activation checkpointing in backward
        if not recompute:
            root.order.append(self)
        self.wait_unshard()
        self.swap_in()
        # prefetch the next module of the previous iteration's order
        k = len(root.order)
        if not recompute and len(root.prev_order) > k and root.prev_order[k - 1] is self:
            root.prev_order[k].start_unshard()
        if self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            dt = self.mp.param_dtype
            cast = lambda t: t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        root = self.root()
        self.swap_out()
        is_root = root is self
        if is_root:
            root.in_forward = False
        tensors, _ = tree_flatten(output)
        needs_grad = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
        if not needs_grad:
            if is_root:  # no backward will come: free everything of this iteration
                for g in root.order:
                    g.reshard()
                for g in root.prev_order:
                    if g.gather is not None:
                        g.reshard()
            elif self.reshard_after_forward:
                self.reshard()
        else:
            # a forward recomputed inside backward (activation checkpointing) keeps its parameters
            # for the backward that follows at once
            if self.reshard_after_forward and not is_root and not root.callback_queued:
                self.reshard()
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        if self.mp.output_dtype is not None:
            dt = self.mp.output_dtype
            output = tree_map(lambda t: t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point()
                              else t, output)
        return output

    # -------------------------------------------------------------------- backward hooks
    def _pre_backward(self, grad: torch.Tensor) -> None:
        root = self.root()
        if not root.callback_queued:
            root.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(root.finish_backward)
        if not self.unsharded:
            self.wait_unshard()
        # prefetch the module before this one in forward order
        order = root.order
        for i in range(len(order) - 1, 0, -1):
            if order[i] is self:
                prev = order[i - 1]
                if not prev.unsharded and prev.gather is None and prev.n_grad:
                    prev.start_unshard()
                break

    def _make_grad_hook(self, i: int) -> Any:
        def hook(p: torch.Tensor) -> None:
            if not self.requires_sync:
                return
            self.accumulated.add(i)
            if len(self.accumulated) == self.n_grad:
                self.reduce()
        return hook

    def reduce(self) -> None:
        """Reduce-scatter the accumulated unsharded gradients (missing ones count as zeros) and
        free the unsharded parameters."""
        self.accumulated.clear()
        dt = self.mp.reduce_dtype or self.mp.param_dtype or self.params[0].dtype
        root = self.root()
        # one reduction in flight (it has overlapped this module's backward): finish it first, so
        # that its input buffer serves this one and a rank holds one module's gradients in flight
        while root.pending:
            _complete(*root.pending.pop(0))
        whole = root.take_buffer(self.n * self.segment, dt, self.params[0].shard.device)
        buf = whole[:self.n * self.segment].view(self.n, self.segment)
        for q in self.params:
            # rank k's rows of this gradient go to row k of the buffer, in the parameter's slot,
            # padded with zeros to ``seg``
            dst = buf[:, q.offset:q.offset + q.seg]
            g = q.unsharded.grad
            if g is None:
                dst.zero_()
                continue
            flat = g.reshape(-1)
            k, rest = divmod(flat.numel(), q.seg)  # k ranks' rows in full, then ``rest`` elements
            dst[:k].copy_(flat[:k * q.seg].view(k, q.seg))
            if k < self.n:
                dst[k, :rest].copy_(flat[k * q.seg:])
                dst[k, rest:].zero_()
                dst[k + 1:].zero_()
            q.unsharded.grad = None
        sent, ctx = self.compression.compress(buf)
        h = mpi_ops.reducescatter_async(sent, name=self.name("reducescatter"), process_set=self.process_set)
        del sent
        root.pending.append((self, h, ctx, whole))
        self.reshard()

    def take_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of at least ``numel`` elements for a reduce-scatter's input (on the
        root): a spare one when one fits, so that the same memory serves every module's reduction
        (no per-block allocation for the allocator to keep)."""
        for i, t in enumerate(self.spare):
            if t.dtype == dtype and t.device == device and t.numel() >= numel:
                return self.spare.pop(i)
        return torch.empty(numel, dtype=dtype, device=device)

    def give_back_buffer(self, whole: torch.Tensor) -> None:
        """A reduce-scatter's input buffer (``take_buffer``'s), its collective finished: kept for the
        next module's reduction (one at most, the largest: ``reduce`` finishes the reduction in
        flight before it takes a buffer, so one buffer serves every module of a backward)."""
        self.spare.append(whole)
        self.spare.sort(key=lambda t: -t.numel())
        del self.spare[1:]

    def finish_backward(self) -> None:
        """At the end of backward (on the root): reduce what is left, add each rank's part to the
        shards' gradients, free every unsharded parameter."""
        assert self.owner is None
        self.callback_queued = False
        for g in self.order:
            if g.requires_sync and g.accumulated:
                g.reduce()
        pending, self.pending = self.pending, []
        for entry in pending:
            _complete(*entry)
        if pending:  # this backward reduced (every rank alike)
            self.agree_finite()
        for g in self.order:
            g.reshard()
        for g in self.prev_order:
            if g.gather is not None:
                g.reshard()


    def agree_finite(self) -> None:
        """After a backward's reductions (on the root): one 1-element allreduce (Max) so that, if
        any rank's shards received a non-finite averaged gradient, every rank makes one of its
        own gradients infinite too, and ``GradScaler`` skips the step on every rank alike (each
        rank checks only its rows; DistributedOptimizer needs nothing, every rank holding every
        average)."""
        shards = [q.shard for m in self.module.modules() if m in _GROUPS for q in _GROUPS[m].params]
        if not any(p.requires_grad for p in shards):
            return
        grads = [p.grad for p in shards if p.grad is not None]
        bad = not all(bool(torch.isfinite(g).all()) for g in grads)
        flag = torch.tensor([1.0 if bad else 0.0], device=shards[0].device)
        flag = mpi_ops.allreduce(flag, op=Max, name="hvd.fully_shard.nonfinite", process_set=self.process_set)
        if float(flag[0]) and not bad:
            for g in grads:
                if g.numel():
                    g.view(-1)[0] = float("inf")
                    break


def _complete(g: _Group, handle: int, ctx: Any, whole: torch.Tensor) -> None:
    """Wait for a module's reduce-scatter; add this rank's part to its shards' gradients."""
    out = g.compression.decompress(mpi_ops.synchronize(handle), ctx).reshape(-1)
    g.root().give_back_buffer(whole)
    for q in g.params:
        if not q.shard.requires_grad:
            continue
        part = out[q.offset:q.offset + q.local_numel].view(q.shard.shape).to(q.dtype)
        if q.shard.grad is None:
            q.shard.grad = part
        else:
            q.shard.grad.add_(part)


def _allgather_object(obj: Any, process_set: ProcessSet) -> list[Any]:
    from horovod.torch.functions import allgather_object
    return allgather_object(obj, name="hvd.fully_shard.check", process_set=process_set)


def _raise_on_difference(everyone: list[list[Any]], indices: list[int]) -> None:
    """``everyone[k]``: each rank's description of the module of call ``indices[k]``."""
    for ranks_desc, index in zip(everyone, indices):
        bad = [i for i, d in enumerate(ranks_desc) if d != ranks_desc[0]]
        if bad:
            diff = _first_difference(ranks_desc[0], ranks_desc[bad[0]])
            raise ValueError(
                f"hvd.fully_shard (call {index} on this rank): ranks {bad} wrap a different module "
                f"than rank 0: {diff}; every rank must call fully_shard on the same modules, in the "
                "same order, with the same parameters")


def check_same_modules(model: torch.nn.Module) -> None:
    """Raise on every rank unless every rank wrapped the same modules of ``model`` with the same
    parameters (what ``fully_shard`` checks at once outside an elastic job). One collective."""
    groups = _groups_in(model)
    if not groups:
        return
    mine = [g.desc for g in groups]
    everyone = _allgather_object(mine, groups[0].process_set)
    if len({len(d) for d in everyone}) > 1:
        raise ValueError(f"hvd.fully_shard: the ranks wrapped {[len(d) for d in everyone]} modules of "
                         f"{type(model).__name__}; every rank must make the same fully_shard calls")
    _raise_on_difference([[d[k] for d in everyone] for k in range(len(mine))], [g.index for g in groups])


def _first_difference(a: list[Any], b: list[Any]) -> str:
    if a[0] != b[0]:
        return f"module {b[0]} != {a[0]}"
    for x, y in zip(a[1:], b[1:]):
        if x != y:
            return f"parameter {y} != {x} (name, shape, dtype)"
    names = lambda d: [t[0] for t in d[1:]]  # noqa: E731
    return f"parameters {names(b)} != {names(a)}"


def _inside(outer: torch.nn.Module, mod: torch.nn.Module) -> bool:
    return any(m is mod for m in outer.modules())


def _group_of_shard(module: torch.nn.Module, p: torch.Tensor) -> _Group | None:
    for m in module.modules():
        g = _GROUPS.get(m)
        if g is not None and any(q.shard is p for q in g.params):
            return g
    return None


class FullyShardedModule:
    """Mixed into a module's class by ``fully_shard`` (as FSDP2's ``FSDPModule``)."""

    def unshard(self, async_op: bool = False) -> None:
        """Allgather this module's parameters now (``async_op``: only start; the forward waits)."""
        g = _GROUPS[self]
        g.start_unshard()
        if not async_op:
            g.wait_unshard()

    def reshard(self) -> None:
        """Free this module's unsharded parameters."""
        _GROUPS[self].reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: backward accumulates unsharded gradients locally and reduces nothing, until a
        backward with ``True`` reduce-scatters the sum (gradient accumulation, as ``no_sync``)."""
        for g in self._groups() if recurse else [_GROUPS[self]]:
            g.requires_sync = bool(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        for g in self._groups() if recurse else [_GROUPS[self]]:
            g.reshard_after_forward = bool(reshard_after_forward)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally; the first one outside reduces the sum."""
        before = [(g, g.requires_sync) for g in self._groups()]
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for g, v in before:
                g.requires_sync = v

    def _groups(self) -> list[_Group]:
        return [_GROUPS[m] for m in self.modules()  # type: ignore[attr-defined]
                if isinstance(m, FullyShardedModule)]

    def _by_name(self) -> dict[str, _Param]:
        """This module's state-dict names of its managed parameters (tied ones under each name)."""
        shards = {id(q.shard): q for g in self._groups() for q in g.params}
        return {n: shards[id(p)] for n, p in self.named_parameters(remove_duplicate=False)  # type: ignore[attr-defined]
                if id(p) in shards}

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the shards' gradients by the norm of the whole (unsharded) gradient; returns it."""
        return clip_grad_norm_(self.parameters(), max_norm, norm_type,  # type: ignore[attr-defined]
                               process_set=_GROUPS[self].process_set)

    # RowShardedStateful (horovod/torch/reducer.py): what hvd.checkpoint reads and writes per rank
    @property
    def num_shards(self) -> int:
        """How many ranks the parameters are split across."""
        return _GROUPS[self].n

    def row_shards(self) -> dict[str, RowShard]:
        """``{state-dict key: the rows this rank holds}`` of every sharded parameter."""
        return row_shards(self)  # type: ignore[arg-type]

    def full_state_dict(self, to: int | None = None) -> dict[str, torch.Tensor]:
        """The unsharded state dict (every parameter whole, buffers as they are), gathered one
        parameter at a time. ``to``: only that rank of the process set receives it (the others
        get ``{}``); ``None``: every rank does."""
        sd = self.state_dict()  # type: ignore[attr-defined]
        full = self._by_name()
        out: dict[str, torch.Tensor] = {}
        g = _GROUPS[self]
        for key, v in sd.items():
            q = full.get(key)
            if q is not None:
                v = _gather_rows(v, q, g.process_set, f"full_state_dict.{key}")
            if to is None or (g.process_set.rank() or 0) == to:
                out[key] = v
        return out

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> Any:
        """Load an unsharded state dict (``full_state_dict()``, or an unsharded model's
        ``state_dict()``): each rank keeps its rows."""
        full = self._by_name()
        local = {}
        r = _GROUPS[self].r
        for key, v in state_dict.items():
            q = full.get(key)
            if q is not None:
                if tuple(v.shape) != q.shape:
                    raise ValueError(f"load_full_state_dict: rank {r}: {key} has shape {tuple(v.shape)}, "
                                     f"the model's is {q.shape}")
                v = v.reshape(q.rows, *q.shape[1:])[q.lo:q.hi].reshape(q.shard.shape)
            local[key] = v
        return self.load_state_dict(local, strict=strict)  # type: ignore[attr-defined]


def _gather_rows(v: torch.Tensor, q: _Param, ps: ProcessSet, name: str) -> torch.Tensor:
    """The whole tensor from every rank's rows ``v`` (shape of ``q.shard``)."""
    n = ps.size() or 1
    send = torch.zeros(q.seg, dtype=v.dtype, device=v.device)
    send[:v.numel()].copy_(v.detach().reshape(-1))
    out = mpi_ops.synchronize(mpi_ops.allgather_async(send, name=f"hvd.fully_shard.{name}", process_set=ps))
    return out.view(n, q.seg).reshape(-1)[:q.rows * q.row_numel].view(q.shape).clone()


# What fully_shard knows of the torch objects it wraps, kept here rather than as attributes on them
# (keyed by identity, never keeping an object alive): a wrapped module's group, a shard's name, and
# an original parameter that a call sharded (so that a later call sees a tie to it).
_GROUPS: Any = WeakIdKeyDictionary()
_SHARD_NAMES: Any = WeakIdKeyDictionary()
_SHARDED_AS: Any = WeakIdKeyDictionary()


def row_shards(model: torch.nn.Module | None) -> dict[str, RowShard]:
    """``{state-dict key: RowShard}`` for every parameter of ``model`` that a ``fully_shard``
    call inside it shards (each name of a tied one); ``{}`` for a model with none."""
    if model is None:
        return {}
    managed = _managed_by_shard(model)
    if not managed:
        return {}
    return {name: RowShard(q.shape, q.lo, q.hi)
            for name, p in model.named_parameters(remove_duplicate=False)
            for q, _ in [managed.get(id(p), (None, None))] if q is not None}


def shard_process_sets(model: torch.nn.Module | None) -> list[ProcessSet]:
    """The process sets over which ``model``'s fully sharded modules are sharded."""
    out: list[ProcessSet] = []
    for m in model.modules() if model is not None else []:
        g = _GROUPS.get(m)
        if g is not None and all(ps is not g.process_set for ps in out):
            out.append(g.process_set)
    return out


def groups_of_params(params: Iterable[torch.Tensor]) -> list[_Group]:
    """The groups whose shards are among ``params`` (an optimizer's parameters)."""
    want = {id(p) for p in params}
    return [g for _, g in list(_GROUPS.items()) if any(id(q.shard) in want for q in g.params)]


def is_shard(p: torch.Tensor) -> bool:
    """Whether ``p`` is a shard that ``fully_shard`` registered in place of a parameter."""
    return p in _SHARD_NAMES


def relayout(groups: Iterable[Any]) -> bool:
    """Lay the shards of ``groups`` (fully sharded modules, or their groups) out again over their
    process set's current size and this rank's current rank there (after an elastic reset): each
    shard keeps its ``nn.Parameter`` object (an optimizer's references stay valid) and gets its
    new rows, zero until a full state dict is loaded; gradients and the iteration's order are
    dropped. Returns whether anything changed. Every rank of the new set must call it."""
    changed = False
    for g in groups:
        g = _GROUPS[g] if isinstance(g, torch.nn.Module) else g
        changed = g.relayout() or changed
    return changed


def fully_shard(module: torch.nn.Module, *, reshard_after_forward: bool = True,
                process_set: ProcessSet = global_process_set, mp_policy: MixedPrecisionPolicy | None = None,
                compression: Any = Compression.none) -> torch.nn.Module:
    """Shard ``module``'s parameters over ``process_set`` (ZeRO-3, FSDP2's ``fully_shard``).

    Apply it to each block first, then to the root. Afterwards ``module.parameters()`` are this
    rank's shards (rows of each parameter), which a plain torch optimizer updates; the forward and
    backward gather each wrapped module's parameters just in time, and backward reduce-scatters
    (averages) the gradients into the shards' ``.grad``. Every rank of the set must make the same
    calls, in the same order. Returns ``module``, whose class now also derives from
    ``FullyShardedModule``.

    Args:
        reshard_after_forward: free the gathered parameters after the forward (gather them again
            for the backward); ``False`` keeps them until the end of backward (more memory, one
            allgather less). The root module keeps its own until backward either way.
        mp_policy: ``MixedPrecisionPolicy``: gather and compute in ``param_dtype``, reduce
            gradients in ``reduce_dtype``; the shards keep their dtype.
        compression: ``hvd.Compression.fp16``/``bf16`` cast the gradients' reduce-scatter;
            the parameters' allgather is never compressed (use ``mp_policy.param_dtype``).
            Stateful compressors (PowerSGD) are refused.

    Raises:
        ValueError: the ranks wrap different modules or parameters (naming them), the module is
            already wrapped, a parameter is shared with a wrapped sibling, an incompatible option.
    """
    if isinstance(module, FullyShardedModule):
        raise ValueError(f"hvd.fully_shard: {type(module).__name__} is already fully sharded")
    if isinstance(compression, StatefulCompressor) or (isinstance(compression, type) and
                                                       issubclass(compression, StatefulCompressor)):
        raise ValueError(f"hvd.fully_shard: compression={type(compression).__name__} is a stateful "
                         "compressor (it averages whole gradients itself); fully sharded gradients are "
                         "reduce-scattered. Use hvd.Compression.fp16/bf16, or mp_policy.reduce_dtype")
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise ValueError(f"hvd.fully_shard: compression={compression!r} is not a hvd.Compression "
                         "(compress/decompress)")
    mp = mp_policy or MixedPrecisionPolicy()
    if not isinstance(mp, MixedPrecisionPolicy):
        raise ValueError(f"hvd.fully_shard: mp_policy must be a hvd.MixedPrecisionPolicy, got {mp!r}")
    if compression is not Compression.none and mp.reduce_dtype is not None:
        raise ValueError(f"hvd.fully_shard: both compression={getattr(compression, '__name__', compression)} "
                         f"and mp_policy.reduce_dtype={mp.reduce_dtype} choose the gradients' wire dtype; "
                         "give one of them")
    if process_set.size() is None:
        raise ValueError(f"hvd.fully_shard: this rank is not in process set {process_set}")
    group = _Group(module, reshard_after_forward, process_set, mp, compression, next_number("fully_shard"))
    group.collect()
    for m in module.modules():
        inner = _GROUPS.get(m)
        if inner is not None and inner.owner is None and m is not module:
            inner.owner = group
    cls = type(module)
    module.__class__ = type(f"FullyShard{cls.__name__}", (FullyShardedModule, cls), {})
    _GROUPS[module] = group
    module.register_forward_pre_hook(group.pre_forward, with_kwargs=True)
    module.register_forward_hook(group.post_forward, with_kwargs=True)
    return module


def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over shards: the norm of the whole gradient (every rank's
    shards of ``parameters``), the same on every rank, and every shard scaled by the same factor.
    Every rank of ``process_set`` must call it."""
    ps = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in ps if p.grad is not None]
    norm_type = float(norm_type)
    dev = grads[0].device if grads else torch.device("cpu")
    if math.isinf(norm_type):
        local = max((g.detach().abs().max().float() for g in grads if g.numel()),
                    default=torch.zeros((), device=dev))
        total = mpi_ops.allreduce(local.reshape(1), op=Max, name="hvd.fully_shard.clip.max",
                                  process_set=process_set)[0]
    else:
        local = sum((g.detach().float().abs().pow(norm_type).sum() for g in grads),
                    torch.zeros((), device=dev))
        total = mpi_ops.allreduce(local.reshape(1), op=Sum, name="hvd.fully_shard.clip.sum",
                                  process_set=process_set)[0] ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    return total


def _managed_by_shard(model: torch.nn.Module | None,
                      optimizer: torch.optim.Optimizer | None = None) -> dict[int, tuple[_Param, ProcessSet]]:
    out = {}
    groups = ([_GROUPS.get(m) for m in model.modules()] if model is not None else
              groups_of_params(p for grp in optimizer.param_groups for p in grp["params"]) if optimizer else [])
    for g in groups:
        if g is not None:
            for q in g.params:
                out[id(q.shard)] = (q, g.process_set)
    return out


def full_optim_state_dict(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer,
                          to: int | None = None) -> dict[str, Any]:
    """The optimizer's state dict as an unsharded model's optimizer would have it (every state
    tensor shaped like its shard gathered whole); ``to`` as in ``full_state_dict``. ``model``
    None: the fully sharded modules whose shards the optimizer steps."""
    managed = _managed_by_shard(model, optimizer)
    sd = optimizer.state_dict()
    params = [p for grp in optimizer.param_groups for p in grp["params"]]
    state: dict[int, dict[str, Any]] = {}
    for idx, p in enumerate(params):
        st = sd["state"].get(idx)
        entry = managed.get(id(p))
        # every rank must gather the same tensors: states exist on every rank once stepped
        if st is None:
            continue
        out = {}
        for k, v in sorted(st.items()):
            if entry is not None and isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == p.shape:
                q, pset = entry
                v = _gather_rows(v, q, pset, f"optim.{q.fqn}.{k}")
            out[k] = v
        state[idx] = out
    r = next(iter(managed.values()))[1].rank() if managed else 0
    if to is not None and r != to:
        return {}
    return {"state": state, "param_groups": sd["param_groups"]}


def load_full_optim_state_dict(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer,
                               state_dict: dict[str, Any]) -> None:
    """Load an unsharded optimizer state dict (``full_optim_state_dict``, or a plain optimizer's
    over the unsharded model's parameters in the same order): each rank keeps its rows.
    ``model`` None: the fully sharded modules whose shards the optimizer steps."""
    managed = _managed_by_shard(model, optimizer)
    params = [p for grp in optimizer.param_groups for p in grp["params"]]
    state = {}
    for idx, st in state_dict["state"].items():
        p = params[int(idx)]
        entry = managed.get(id(p))
        out = {}
        for k, v in st.items():
            # per-element state has the parameter's shape; of a 0-d parameter's 0-d state
            # tensors, "step" is the one that is not per element
            if entry is not None and isinstance(v, torch.Tensor) and (v.dim() > 0 or (
                    not entry[0].shape and k != "step")):
                q = entry[0]
                if tuple(v.shape) != q.shape:
                    raise ValueError(f"load_full_optim_state_dict: rank {entry[1].rank()}: state {k} of "
                                     f"{q.fqn} has shape {tuple(v.shape)}, the parameter's is {q.shape}")
                v = v.reshape(q.rows, *q.shape[1:])[q.lo:q.hi].reshape(p.shape).clone()
            out[k] = v
        state[idx] = out
    optimizer.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})


class FullyShardedReducer(SkipSynchronize):
    """The ``GradientReducer`` (``horovod/torch/reducer.py``) of a fully sharded model, for a plain
    optimizer over its shards (ZeRO stage 3): the reduce-scatters are the wrapped modules' own,
    run in backward, so a step's gradients are in the shards by the end of backward; this object
    only lets code written for the protocol (the Lightning strategy, ``clip_grad_norm_``) drive
    it. ``backward_passes_per_step`` > 1 is gradient accumulation through
    ``set_requires_gradient_sync`` (only the last pass of a window reduces): the caller turns
    sync off for the other passes (``accumulating(last)``)."""

    def __init__(self, module: torch.nn.Module | FullyShardedModule) -> None:
        if not isinstance(module, FullyShardedModule) or not isinstance(module, torch.nn.Module):
            raise ValueError(f"FullyShardedReducer: {type(module).__name__} is not fully sharded "
                             "(call hvd.fully_shard on it, its root module last)")
        self.module = module
        self._passes = 1

    @property
    def _root(self) -> _Group:
        return _GROUPS[self.module].root()

    @property
    def backward_passes_per_step(self) -> int:
        return self._passes

    def set_backward_passes_per_step(self, passes: int) -> None:
        if passes <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self._passes = int(passes)

    def accumulating(self, last: bool) -> None:
        """Whether the next backward pass reduces (``last`` of an accumulation window) or only
        accumulates the unsharded gradients locally."""
        self.module.set_requires_gradient_sync(last)

    def register_hooks(self) -> None:
        """Nothing to add: the wrapped modules' hooks (``fully_shard``) reduce."""

    def remove_hooks(self) -> None:
        """Nothing to remove (see ``register_hooks``)."""

    def pending(self) -> bool:
        root = self._root
        return bool(root.pending) or root.callback_queued or any(g.accumulated for g in _groups_in(self.module))

    def synchronize(self) -> None:
        """Finish a backward whose end-of-backward callback did not run (reductions left in
        flight); nothing to do after a complete backward pass. Repeated calls do nothing."""
        if self.pending():
            self._root.finish_backward()

    def check_idle(self) -> None:
        if self._root.pending:
            raise AssertionError("fully sharded gradients are being reduce-scattered; finish "
                                 "backward() (or call synchronize()) before zero_grad()")

    def reset(self) -> None:
        root = self._root
        root.pending, root.callback_queued = [], False
        for g in _groups_in(self.module):
            g.accumulated.clear()
            for q in g.params:
                q.unsharded.grad = None
            g.reshard()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the shards' gradients by the norm of the whole gradient (one allreduce)."""
        self.synchronize()
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]  # type: ignore[attr-defined]
        return clip_by_global_norm(grads, grads, max_norm, norm_type, _GROUPS[self.module].process_set,
                                   "hvd.fully_shard", error_if_nonfinite)


def _groups_in(module: torch.nn.Module) -> list[_Group]:
    return [_GROUPS[m] for m in module.modules() if m in _GROUPS]


_REDUCERS: Any = WeakIdKeyDictionary()


def reducer_for(module: torch.nn.Module | FullyShardedModule) -> FullyShardedReducer:
    """The ``FullyShardedReducer`` of a fully sharded root module (one per module)."""
    r = _REDUCERS.get(module)
    if r is None:
        r = _REDUCERS[module] = FullyShardedReducer(module)
    return r
