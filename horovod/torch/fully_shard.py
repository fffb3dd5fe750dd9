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
``mp_policy.param_dtype``) are allgathered in one grouped collective (each parameter's rows padded
to ``c``, its own output), and each unsharded parameter shows its output as it is (no copy); they
are swapped in for the forward and swapped out after it. With ``reshard_after_forward`` the outputs
are dropped after the forward and gathered anew before the module's backward: saved-tensor hooks
pushed for the module's forward keep autograd's saved views of a parameter by parameter, not by
storage (under someone else's saved-tensor hooks, e.g. activation checkpointing, the parameters
keep their own storage for the iteration instead, resized to 0 and refilled). The next module is
allgathered ahead (the order of the previous iteration forward, its reverse in backward). When
every gradient of a module has been accumulated, they are reduce-scattered (``op=Average``, in
``mp_policy.reduce_dtype``; the gradients themselves when no cast is needed and the engine splits
their rows as the shards, else packed into one buffer); the end of backward waits for them and
adds each rank's part to its shards' ``.grad``. See docs/fully_shard.md.

The machinery lives in modules named for their role: ``_shard_params`` (each parameter's row
layout, shard and unsharded tensor), ``_shard_group`` (a wrapped module's state),
``_shard_collectives`` (allgather, reduce-scatter, their buffers), ``_shard_hooks`` (forward and
backward hooks), ``_shard_state`` (state dicts and checkpoint rows), ``_shard_relayout`` (elastic),
``_shard_checks`` (every rank wrapped the same modules), ``_shard_reducer`` (the
``GradientReducer``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from horovod.common.job_state import next_number
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.common.types import Max, Sum
from horovod.torch import mpi_ops
from horovod.torch._shard_checks import check_same_modules
from horovod.torch._shard_collectives import reshard, start_unshard, wait_unshard
from horovod.torch._shard_group import ShardGroup
from horovod.torch._shard_hooks import install
from horovod.torch._shard_params import GROUPS
from horovod.torch._shard_reducer import FullyShardedReducer, reducer_for
from horovod.torch._shard_relayout import relayout
from horovod.torch._shard_state import (
    full_optim_state_dict,
    full_state_dict,
    groups_of_params,  # noqa: F401 - horovod.torch.elastic.state's
    is_shard,  # noqa: F401 - the Lightning strategy's and horovod.torch.elastic.state's
    load_full_optim_state_dict,
    load_full_state_dict,
    row_shards,
    shard_process_sets,  # noqa: F401 - hvd.checkpoint's
)
from horovod.torch.compression import Compression, StatefulCompressor
from horovod.torch.reducer import RowShard

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
    group = ShardGroup(module, reshard_after_forward, process_set, mp, compression, next_number("fully_shard"))
    group.collect()
    for m in module.modules():
        inner = GROUPS.get(m)
        if inner is not None and inner.owner is None and m is not module:
            inner.owner = group
    cls = type(module)
    module.__class__ = type(f"FullyShard{cls.__name__}", (FullyShardedModule, cls), {})
    GROUPS[module] = group
    install(group)
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


class FullyShardedModule:
    """Mixed into a module's class by ``fully_shard`` (as FSDP2's ``FSDPModule``)."""

    def unshard(self, async_op: bool = False) -> None:
        """Allgather this module's parameters now (``async_op``: only start; the forward waits)."""
        g = GROUPS[self]
        start_unshard(g)
        if not async_op:
            wait_unshard(g)

    def reshard(self) -> None:
        """Free this module's unsharded parameters."""
        reshard(GROUPS[self])

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: backward accumulates unsharded gradients locally and reduces nothing, until a
        backward with ``True`` reduce-scatters the sum (gradient accumulation, as ``no_sync``)."""
        for g in self._groups() if recurse else [GROUPS[self]]:
            g.requires_sync = bool(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        for g in self._groups() if recurse else [GROUPS[self]]:
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

    def _groups(self) -> list[ShardGroup]:
        return [GROUPS[m] for m in self.modules()  # type: ignore[attr-defined]
                if isinstance(m, FullyShardedModule)]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the shards' gradients by the norm of the whole (unsharded) gradient; returns it."""
        return clip_grad_norm_(self.parameters(), max_norm, norm_type,  # type: ignore[attr-defined]
                               process_set=GROUPS[self].process_set)

    # RowShardedStateful (horovod/torch/reducer.py): what hvd.checkpoint reads and writes per rank
    @property
    def num_shards(self) -> int:
        """How many ranks the parameters are split across."""
        return GROUPS[self].n

    def row_shards(self) -> dict[str, RowShard]:
        """``{state-dict key: the rows this rank holds}`` of every sharded parameter."""
        return row_shards(self)  # type: ignore[arg-type]

    def full_state_dict(self, to: int | None = None) -> dict[str, torch.Tensor]:
        """The unsharded state dict (every parameter whole, buffers as they are), gathered one
        parameter at a time. ``to``: only that rank of the process set receives it (the others
        get ``{}``); ``None``: every rank does."""
        return full_state_dict(self, to)  # type: ignore[arg-type]

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> Any:
        """Load an unsharded state dict (``full_state_dict()``, or an unsharded model's
        ``state_dict()``): each rank keeps its rows."""
        return load_full_state_dict(self, state_dict, strict)  # type: ignore[arg-type]
