"""State dicts of fully sharded modules and of the optimizers over their shards: the rows each
rank holds (``row_shards``, what ``hvd.checkpoint`` writes and reads per rank), the unsharded
state dicts gathered one tensor at a time (``full_state_dict``, ``full_optim_state_dict``) and
loaded back keeping each rank's rows."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from horovod.common.process_sets import ProcessSet
from horovod.torch._shard_group import ShardGroup, groups_in
from horovod.torch._shard_params import GROUPS, SHARD_NAMES, ShardedParam, gather_rows
from horovod.torch.reducer import RowShard

__all__ = ["row_shards", "shard_process_sets", "groups_of_params", "is_shard", "full_state_dict",
           "load_full_state_dict", "full_optim_state_dict", "load_full_optim_state_dict"]


def _by_name(module: torch.nn.Module) -> dict[str, ShardedParam]:
    """``module``'s state-dict names of its managed parameters (tied ones under each name)."""
    shards = {id(q.shard): q for g in groups_in(module) for q in g.params}
    return {n: shards[id(p)] for n, p in module.named_parameters(remove_duplicate=False) if id(p) in shards}


def row_shards(model: torch.nn.Module | None) -> dict[str, RowShard]:
    """``{state-dict key: RowShard}`` for every parameter of ``model`` that a ``fully_shard``
    call inside it shards (each name of a tied one); ``{}`` for a model with none."""
    if model is None:
        return {}
    return {name: RowShard(q.shape, q.lo, q.hi) for name, q in _by_name(model).items()}


def shard_process_sets(model: torch.nn.Module | None) -> list[ProcessSet]:
    """The process sets over which ``model``'s fully sharded modules are sharded."""
    out: list[ProcessSet] = []
    for g in groups_in(model) if model is not None else []:
        if all(ps is not g.process_set for ps in out):
            out.append(g.process_set)
    return out


def groups_of_params(params: Iterable[torch.Tensor]) -> list[ShardGroup]:
    """The groups whose shards are among ``params`` (an optimizer's parameters)."""
    want = {id(p) for p in params}
    return [g for _, g in list(GROUPS.items()) if any(id(q.shard) in want for q in g.params)]


def is_shard(p: torch.Tensor) -> bool:
    """Whether ``p`` is a shard that ``fully_shard`` registered in place of a parameter."""
    return p in SHARD_NAMES


def full_state_dict(module: torch.nn.Module, to: int | None = None) -> dict[str, torch.Tensor]:
    """``module``'s unsharded state dict (see ``FullyShardedModule.full_state_dict``)."""
    sd = module.state_dict()
    full = _by_name(module)
    out: dict[str, torch.Tensor] = {}
    ps = GROUPS[module].process_set
    for key, v in sd.items():
        q = full.get(key)
        if q is not None:
            v = gather_rows(v, q, ps, f"full_state_dict.{key}")
        if to is None or (ps.rank() or 0) == to:
            out[key] = v
    return out


def load_full_state_dict(module: torch.nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> Any:
    """Load an unsharded state dict into ``module``, each rank keeping its rows."""
    full = _by_name(module)
    local = {}
    r = GROUPS[module].r
    for key, v in state_dict.items():
        q = full.get(key)
        if q is not None:
            if tuple(v.shape) != q.shape:
                raise ValueError(f"load_full_state_dict: rank {r}: {key} has shape {tuple(v.shape)}, "
                                 f"the model's is {q.shape}")
            v = v.reshape(q.rows, *q.shape[1:])[q.lo:q.hi].reshape(q.shard.shape)
        local[key] = v
    return module.load_state_dict(local, strict=strict)


def _managed(model: torch.nn.Module | None,
             optimizer: torch.optim.Optimizer | None = None) -> dict[int, tuple[ShardedParam, ProcessSet]]:
    groups = (groups_in(model) if model is not None else
              groups_of_params(p for grp in optimizer.param_groups for p in grp["params"]) if optimizer else [])
    return {id(q.shard): (q, g.process_set) for g in groups for q in g.params}


def full_optim_state_dict(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer,
                          to: int | None = None) -> dict[str, Any]:
    """The optimizer's state dict as an unsharded model's optimizer would have it (every state
    tensor shaped like its shard gathered whole); ``to`` as in ``full_state_dict``. ``model``
    None: the fully sharded modules whose shards the optimizer steps."""
    managed = _managed(model, optimizer)
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
                v = gather_rows(v, q, pset, f"optim.{q.fqn}.{k}")
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
    managed = _managed(model, optimizer)
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
