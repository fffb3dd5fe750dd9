"""The sharded states of an elastic job, committed as ``_replicated.ReplicatedStateHandler`` does
(each rank: its own part plus a replica of the next rank's on the ring, about 2/N of the whole):

- ``FullyShardedModelStateHandler``: a ``hvd.fully_shard`` model's rows of every parameter (its
  buffers, which every rank holds whole, are kept whole);
- ``FullyShardedOptimizerStateHandler``: a plain torch optimizer over such a model's shards: the
  rows of each per-element state (AdamW's ``exp_avg``, ``exp_avg_sq``, SGD's momentum), the
  values that are one per parameter (``step``) and the groups' options;
- ``ZeroOptimizerStateHandler``: a ``ZeroRedundancyOptimizer``'s shard (the state of the
  parameters this rank owns), re-partitioned over the new world after a reset.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from horovod.common.process_sets import ProcessSet
from horovod.torch._shard_checks import check_same_modules
from horovod.torch._shard_group import groups_in
from horovod.torch._shard_params import ShardedParam
from horovod.torch._shard_relayout import relayout
from horovod.torch._shard_state import groups_of_params
from horovod.torch.elastic._replicated import Entry, ReplicatedStateHandler, rows_meta

__all__ = ["FullyShardedModelStateHandler", "FullyShardedOptimizerStateHandler",
           "ZeroOptimizerStateHandler"]


def _one_process_set(groups: list[Any], what: str) -> ProcessSet:
    sets: list[ProcessSet] = []
    for g in groups:
        if all(ps is not g.process_set for ps in sets):
            sets.append(g.process_set)
    if len(sets) > 1:
        raise ValueError(f"hvd.elastic.TorchState: the {what} is fully sharded over {len(sets)} process "
                         f"sets ({', '.join(map(str, sets))}); a sharded commit needs one. Pass "
                         "replicas='all' to TorchState (every rank keeps the whole committed state)")
    if not sets:
        raise ValueError(f"hvd.elastic.TorchState: the {what} has no fully sharded module")
    return sets[0]


def _options(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in groups]


class FullyShardedModelStateHandler(ReplicatedStateHandler):
    """A fully sharded model's committed rows (see the module docstring). Its ``sync`` also
    checks that every rank (a worker that joined included) wrapped the same modules."""

    label = "fully sharded model"

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self._ps = _one_process_set(groups_in(model), "model")

    def _process_set(self) -> ProcessSet:
        return self._ps

    def _params(self) -> dict[str, ShardedParam]:
        out: dict[str, ShardedParam] = {}
        seen: set[int] = set()
        shards = {id(q.shard): q for g in groups_in(self.value) for q in g.params}
        for name, p in self.value.named_parameters(remove_duplicate=False):
            q = shards.get(id(p))
            if q is not None and id(q) not in seen:
                seen.add(id(q))
                out[name] = q
        return out

    def _part(self) -> dict[Any, Entry]:
        part: dict[Any, Entry] = {}
        for name, q in self._params().items():
            v = q.shard.detach().reshape(q.hi - q.lo, *q.shape[1:])
            part[("p", name)] = ("rows", q.lo, q.hi, q.rows, rows_meta(v), v.clone())
        managed = {id(q.shard) for q in self._params().values()}
        for name, p in self.value.named_parameters():
            if id(p) not in managed:  # a parameter no wrapped module shards: whole everywhere
                part[("w", name)] = ("same", 0, 1, 1, None, p.detach().clone())
        for name, b in self.value.named_buffers():
            part[("b", name)] = ("same", 0, 1, 1, None, b.detach().clone())
        return part

    def _relayout(self) -> None:
        relayout(groups_in(self.value))

    def _install(self, values: dict[Any, Any]) -> None:
        params = self._params()
        others = dict(self.value.named_parameters())
        buffers = dict(self.value.named_buffers())
        for (kind, name), v in values.items():
            if kind == "p":
                q = params[name]
                q.shard.data.copy_(v.reshape(q.shard.shape))
            elif kind == "w":
                others[name].data.copy_(v)
            else:
                buffers[name].copy_(v)

    def sync(self) -> None:
        check_same_modules(self.value)
        super().sync()


class FullyShardedOptimizerStateHandler(ReplicatedStateHandler):
    """A plain torch optimizer over a fully sharded model's shards (see the module docstring)."""

    label = "fully sharded optimizer state"

    def __init__(self, optimizer: Any) -> None:
        super().__init__(optimizer)
        self._ps = _one_process_set(self._groups(), "optimizer's model")

    def _groups(self) -> list[Any]:
        return groups_of_params(p for g in self.value.param_groups for p in g["params"])

    def _process_set(self) -> ProcessSet:
        return self._ps

    def _params(self) -> list[tuple[torch.Tensor, ShardedParam | None]]:
        managed = {id(q.shard): q for g in self._groups() for q in g.params}
        return [(p, managed.get(id(p))) for g in self.value.param_groups for p in g["params"]]

    def _part(self) -> dict[Any, Entry]:
        params = self._params()
        sd = self.value.state_dict()
        part: dict[Any, Entry] = {("groups",): ("same", 0, 1, 1, None, _options(sd["param_groups"]))}
        for i, st in sd["state"].items():
            p, q = params[i]
            for k, v in st.items():
                if q is not None and isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == p.shape:
                    rows = v.detach().reshape(q.hi - q.lo, *q.shape[1:])
                    part[("s", i, k)] = ("rows", q.lo, q.hi, q.rows, rows_meta(rows), rows.clone())
                else:  # one value per parameter (``step``), the same on every rank
                    part[("s", i, k)] = ("same", 0, 1, 1, None,
                                         v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
        return part

    def _relayout(self) -> None:
        relayout(self._groups())

    def _install(self, values: dict[Any, Any]) -> None:
        params = self._params()
        state: dict[int, dict[str, Any]] = {}
        options = values.get(("groups",)) or _options(self.value.param_groups)
        for key, v in values.items():
            if key[0] != "s":
                continue
            _, i, k = key
            p, q = params[i]
            if isinstance(v, torch.Tensor) and q is not None and v.dim() > 0 and key_is_rows(v, q):
                v = v.reshape(p.shape).clone()
            state.setdefault(i, {})[k] = v
        groups, start = [], 0
        for g, opts in zip(self.value.param_groups, options):
            groups.append({**opts, "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        self.value.load_state_dict({"state": state, "param_groups": groups})


def key_is_rows(v: torch.Tensor, q: ShardedParam) -> bool:
    """Whether ``v`` is rows of the parameter ``q`` (this rank's rows: the shard's number)."""
    return tuple(v.shape[1:]) == tuple(q.shape[1:]) and v.shape[0] == q.hi - q.lo


class ZeroOptimizerStateHandler(ReplicatedStateHandler):
    """A ``ZeroRedundancyOptimizer``'s shard (see the module docstring): the state of each
    parameter is one entry of the rank that owns it."""

    label = "ZeroRedundancyOptimizer state"

    def _process_set(self) -> ProcessSet:
        return self.value.process_set

    def _part(self) -> dict[Any, Entry]:
        part: dict[Any, Entry] = {("groups",): ("same", 0, 1, 1, None, _options(self.value.param_groups))}
        for i, st in self.value.local_state_dict().items():
            part[("z", i)] = ("owner", 0, 1, 1, None,
                              {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                               for k, v in st.items()})
        return part

    def _needs(self, n: int, kinds: dict[Any, tuple[str, int]]) -> dict[int, dict[Any, tuple[int, int]]]:
        owner = self.value.layout.owner  # after _relayout: the new world's partition
        out: dict[int, dict[Any, tuple[int, int]]] = {j: {} for j in range(n)}
        for key, (kind, _) in kinds.items():
            for j in range(n):
                if kind != "owner" or owner[key[1]] == j:
                    out[j][key] = (0, 1)
        return out

    def _relayout(self) -> None:
        if (self.value.world, self.value.rank) != self._world():
            self.value.repartition()

    def _install(self, values: dict[Any, Any]) -> None:
        options = values.get(("groups",)) or _options(self.value.param_groups)
        state = {key[1]: v for key, v in values.items() if key[0] == "z"}
        groups, start = [], 0
        for g, opts in zip(self.value.param_groups, options):
            groups.append({**opts, "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        self.value.load_state_dict({"state": state, "param_groups": groups})
