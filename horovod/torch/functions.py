"""Helpers that keep model and optimizer state identical on every rank (``horovod.torch.functions``)."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

import torch

from horovod.common.objects import allgather_object, broadcast_object
from horovod.common.process_sets import global_process_set
from horovod.torch.mpi_ops import broadcast_async_, synchronize

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def _named_tensors(params: Any) -> list[tuple[str | None, torch.Tensor]]:
    if isinstance(params, dict):
        items: list[tuple[Any, Any]] = sorted(params.items(), key=lambda kv: str(kv[0]))
    elif isinstance(params, (torch.Tensor, str, bytes)) or not isinstance(params, Iterable):
        raise ValueError(f"invalid params of type: {type(params)}")
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    out = []
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"broadcast_parameters: entry {name!r} is a {type(t).__name__}, not a tensor; "
                             "pass model.state_dict(), model.named_parameters() or a list of tensors.")
        out.append((None if name is None else str(name), t))
    return out


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite ``params`` on every rank with the root rank's values, in place.

    Every rank must call it with the same keys. ``params`` is a dict such as ``model.state_dict()``
    (keys, sorted, become the operation names) or a list/iterable of tensors or ``(name, tensor)``
    pairs such as ``model.named_parameters()``. All broadcasts are submitted first, then awaited,
    so the engine fuses them. Global process set only.

    Raises:
        ValueError: ``params`` is of another type, or holds something that is not a tensor.
        HorovodInternalError: ranks disagree on shapes or dtypes.
    """
    named = _named_tensors(params)
    handles = [broadcast_async_(t, root_rank, name) for name, t in named]
    for h in handles:
        synchronize(h)


def _sparse_embedding_params(model: torch.nn.Module | None) -> set[int]:
    if model is None:
        return set()
    return {id(m.weight) for m in model.modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}


def _initialize_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> None:
    """Give a fresh optimizer its state by one local step on zero gradients (upstream's approach)."""
    from horovod.torch.optimizer import _DistributedOptimizer

    sparse_ids = _sparse_embedding_params(model)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p not in optimizer.state:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or (
                        isinstance(optimizer, torch.optim.SGD) and id(p) in sparse_ids):
                    p.grad = p.grad.to_sparse()
    # A DistributedOptimizer's step() would allreduce (and deadlock unless every rank steps):
    # run the wrapped optimizer's own step instead.
    if isinstance(optimizer, _DistributedOptimizer):
        optimizer.local_step()
    else:
        optimizer.step()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: torch.nn.Module | None = None) -> None:
    """Make the optimizer state and hyper-parameters of every rank equal to the root rank's.

    Every rank must call it. A fresh optimizer (no state yet) first takes one local step on zero
    gradients to create its state; a stateless optimizer returns without communicating. Tensor
    state (momentum buffers, ``step`` counters...) is broadcast in place; scalar state and the
    options of every param group (``lr``, ``momentum``, ``betas``...) travel in one object
    broadcast and are written back with their types.

    Args:
        optimizer: a ``torch.optim.Optimizer`` or a ``DistributedOptimizer``.
        root_rank: global rank whose state wins.
        model: the model, only to find sparse ``nn.Embedding`` params of an ``SGD`` optimizer.

    Raises:
        ValueError: ``optimizer`` is ``torch.optim.LBFGS``.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if len(optimizer.state) == 0:
        _initialize_state(optimizer, model)
    if len(optimizer.state) == 0:
        return  # stateless optimizer: nothing to broadcast

    tensors: list[tuple[str, torch.Tensor]] = []
    scalars: dict[str, Any] = {}
    setters: dict[str, tuple[dict[Any, Any], Any]] = {}
    occurrences: collections.defaultdict[str, int] = collections.defaultdict(int)
    for index, group in enumerate(optimizer.param_groups):
        for option, value in group.items():
            if option == "params":
                continue
            key = f"{option}.{index}"
            scalars[key] = value
            setters[key] = (group, option)
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue  # e.g. requires_grad=False: never stepped
            for name, value in state.items():
                occurrences[str(name)] += 1
                key = f"{name}.{occurrences[str(name)]}"
                if isinstance(value, torch.Tensor):
                    tensors.append((key, value))
                else:
                    scalars[key] = value
                    setters[key] = (state, name)

    broadcast_parameters(tensors, root_rank)
    synced = broadcast_object(scalars, root_rank, name="broadcast_optimizer_state.scalars",
                              process_set=global_process_set)
    for key, value in synced.items():
        target = setters.get(key)
        if target is not None:
            holder, field = target
            holder[field] = value
