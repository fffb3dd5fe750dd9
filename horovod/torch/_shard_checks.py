"""That every rank of a process set wrapped the same modules with the same parameters
(``hvd.fully_shard``): each wrapped module's description (class, then each parameter's name, shape
and dtype), compared across the ranks, and the error that names the ranks and what differs."""

from __future__ import annotations

from typing import Any

import torch

from horovod.common.process_sets import ProcessSet
from horovod.torch._shard_params import GROUPS

__all__ = ["describe", "allgather_object", "raise_on_difference", "check_same_modules"]


def describe(module: torch.nn.Module, params: list[tuple[str, torch.Tensor]]) -> list[Any]:
    return [type(module).__name__] + [(n, tuple(p.shape), str(p.dtype)) for n, p in params]


def allgather_object(obj: Any, process_set: ProcessSet) -> list[Any]:
    from horovod.torch.functions import allgather_object

    return allgather_object(obj, name="hvd.fully_shard.check", process_set=process_set)


def raise_on_difference(everyone: list[list[Any]], indices: list[int]) -> None:
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
    groups = [GROUPS[m] for m in model.modules() if m in GROUPS]
    if not groups:
        return
    mine = [g.desc for g in groups]
    everyone = allgather_object(mine, groups[0].process_set)
    if len({len(d) for d in everyone}) > 1:
        raise ValueError(f"hvd.fully_shard: the ranks wrapped {[len(d) for d in everyone]} modules of "
                         f"{type(model).__name__}; every rank must make the same fully_shard calls")
    raise_on_difference([[d[k] for d in everyone] for k in range(len(mine))], [g.index for g in groups])


def _first_difference(a: list[Any], b: list[Any]) -> str:
    if a[0] != b[0]:
        return f"module {b[0]} != {a[0]}"
    for x, y in zip(a[1:], b[1:]):
        if x != y:
            return f"parameter {y} != {x} (name, shape, dtype)"
    names = lambda d: [t[0] for t in d[1:]]  # noqa: E731
    return f"parameters {names(b)} != {names(a)}"
