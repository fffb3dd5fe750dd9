"""What each rank of ``hvd.checkpoint.save`` writes (its part of the flat state dict, and which
entries are rows of a larger tensor), and the optimizer facts that ``save`` records and ``load``
checks (its class, its hyper-parameter names, its parameters' names)."""

from __future__ import annotations

import math
from typing import Any

import torch

from horovod.common.basics import is_initialized, rank, size
from horovod.torch.reducer import RowShard, ShardedStateful
from horovod.torch.zero import partition_by_bytes

__all__ = ["FORMAT_VERSION", "local_part", "optimizer_list", "row_layout", "world"]

FORMAT_VERSION = 2  # 2: the versioned directory, the optimizer's class and hyper-parameter names


def world() -> tuple[int, int]:
    return (rank(), size()) if is_initialized() else (0, 1)


def _nbytes(v: Any) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 64


def _param_names(model: torch.nn.Module | None, params: list[torch.Tensor]) -> list[str]:
    names = {}
    if model is not None:
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    return [names.get(id(p), f"param{i}") for i, p in enumerate(params)]


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _algorithm(optimizer: torch.optim.Optimizer) -> type:
    """The optimizer class whose state a checkpoint holds: the wrapped class of a
    ``ZeroRedundancyOptimizer`` or a ``DistributedOptimizer``, else the optimizer's own class."""
    inner = getattr(optimizer, "optim", None)  # a ZeroRedundancyOptimizer's local optimizer
    if isinstance(inner, torch.optim.Optimizer):
        return type(inner)
    for cls in type(optimizer).__mro__:  # DistributedOptimizer: a subclass of a horovod mixin
        if not any(c.__module__.startswith("horovod.") for c in cls.__mro__):
            return cls
    return type(optimizer)


def _hyperparameters(groups: list[dict[str, Any]]) -> list[str]:
    return sorted({k for g in groups for k in g if k != "params"})


def row_layout(model: torch.nn.Module | None, n: int, what: str) -> dict[str, RowShard]:
    """The rows each sharded parameter of a fully sharded ``model`` holds here (``{}`` for any
    other model); its process sets must span the job."""
    from horovod.torch.fully_shard import row_shards, shard_process_sets

    for ps in shard_process_sets(model):
        if ps.size() != n:
            raise ValueError(f"hvd.checkpoint.{what}: {type(model).__name__} is fully sharded over "
                             f"{ps.size()} ranks (process set {ps}), the job has {n}; checkpoints "
                             "of a fully sharded model need it sharded over the global process set")
    return row_shards(model)


def _add_rows(out: dict[str, Any], rows: dict[str, RowShard], key: str, v: torch.Tensor,
              rs: RowShard) -> None:
    """Write ``v``, this rank's rows of the tensor ``rs.shape``, as its chunk of the whole tensor
    (a 0-d tensor: whole, by the rank that holds its one row; nothing where no row is held)."""
    if tuple(v.shape) != rs.local_shape:
        raise ValueError(f"hvd.checkpoint.save: {key} has shape {tuple(v.shape)} on rank "
                         f"{world()[0]}, its rows {rs.lo}:{rs.hi} of {rs.shape} have {rs.local_shape}")
    if rs.hi <= rs.lo:
        return
    if not rs.shape:
        out[key] = v.reshape(())
    else:
        out[key], rows[key] = v, rs


def _per_element(v: Any, rs: RowShard | None) -> bool:
    """Whether the optimizer state ``v`` of a sharded parameter is per element (rows, like the
    shard) rather than one value for the parameter (``step``)."""
    return rs is not None and isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == rs.local_shape


def optimizer_list(optimizer: Any) -> list[tuple[str, torch.optim.Optimizer]]:
    """``(key prefix, optimizer)`` of each optimizer given to ``save``/``load``: ``optim`` for one,
    ``optim.<i>`` for each of a list (several optimizers, as a GAN's or Lightning's)."""
    if optimizer is None:
        return []
    if isinstance(optimizer, (list, tuple)):
        return [(f"optim.{i}", o) for i, o in enumerate(optimizer)]
    return [("optim", optimizer)]


def _header(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    cls = _algorithm(optimizer)
    return {"optimizer": cls.__name__, "optimizer_module": cls.__module__,
            "hyperparameters": _hyperparameters(optimizer.param_groups)}


def local_part(model: torch.nn.Module | None, optimizer: Any, extra: dict[str, Any] | None, r: int,
                n: int) -> tuple[dict[str, Any], dict[str, RowShard]]:
    """The flat state dict this rank writes, and which of its entries are rows of a larger
    tensor (a fully sharded parameter's, or their optimizer state's)."""
    out: dict[str, Any] = {}
    rows: dict[str, RowShard] = {}
    layout = row_layout(model, n, "save")
    if model is not None:
        sd = model.state_dict()
        items = [(k, v) for k, v in sd.items() if k not in layout]
        owner = partition_by_bytes([_nbytes(v) for _, v in items], n)
        out.update({f"model.{k}": v for (k, v), o in zip(items, owner) if o == r})
        for key, rs in layout.items():
            if key in sd:
                _add_rows(out, rows, f"model.{key}", sd[key], rs)
    optimizers = optimizer_list(optimizer)
    for prefix, opt in optimizers:
        _optimizer_part(out, rows, prefix, opt, model, layout, r, n)
    if r == 0:
        out["extra"] = dict(extra or {})
        out["horovod"] = {"format": FORMAT_VERSION, "world_size": n, "optimizer": None}
        if isinstance(optimizer, (list, tuple)):
            out["horovod"]["optimizers"] = [_header(o) for _, o in optimizers]
        elif optimizer is not None:
            out["horovod"].update(_header(optimizer))
    return out, rows


def _optimizer_part(out: dict[str, Any], rows: dict[str, RowShard], prefix: str,
                    optimizer: torch.optim.Optimizer, model: torch.nn.Module | None,
                    layout: dict[str, RowShard], r: int, n: int) -> None:
    """Add what this rank writes of ``optimizer`` to ``out`` under ``prefix``."""
    params = _optimizer_params(optimizer)
    names = _param_names(model, params)
    if isinstance(optimizer, ShardedStateful):
        kind = type(optimizer).__name__
        if optimizer.num_shards != n:
            raise ValueError(f"hvd.checkpoint.save: the {kind} is sharded over "
                             f"{optimizer.num_shards} ranks, the job has {n}; checkpoints of a "
                             f"{kind} need it on the global process set")
        if layout:
            raise ValueError(f"hvd.checkpoint.save: a {kind} over a fully sharded model: its "
                             "parameters are already shards; step them with a plain torch "
                             "optimizer (torch.optim.AdamW(model.parameters()))")
        mine = optimizer.local_state_dict()
    else:
        full = optimizer.state_dict()["state"]
        # ownership by the whole parameter's bytes: the same on every rank
        sizes = [math.prod(layout[nm].shape) * p.element_size() if nm in layout
                 else p.numel() * p.element_size() for nm, p in zip(names, params)]
        owner = partition_by_bytes(sizes, n)
        mine = {}
        for i, st in full.items():
            row = layout.get(names[i])
            for sk, v in st.items():
                if row is not None and _per_element(v, row):
                    _add_rows(out, rows, f"{prefix}.state.{names[i]}.{sk}", v, row)
                elif owner[i] == r:
                    mine.setdefault(i, {})[sk] = v
    for i, st in mine.items():
        for sk, v in st.items():
            out[f"{prefix}.state.{names[i]}.{sk}"] = v
    if r == 0:
        groups, start = [], 0
        for g in optimizer.param_groups:
            k = len(g["params"])
            groups.append({**{a: b for a, b in g.items() if a != "params"},
                           "params": names[start:start + k]})
            start += k
        out[f"{prefix}.param_groups"] = groups
