"""Lightning checkpoints of ``HorovodStrategy(zero_stage=1|2|3)``, sharded: each rank writes its part
with ``hvd.checkpoint`` (a ``torch.distributed.checkpoint`` directory at the checkpoint's path), as
Lightning's FSDP strategy writes its sharded checkpoints.

- ``optimizer_state`` gives Lightning a marker instead of the state (no consolidation), for each
  optimizer (stage 3 may have several, saved under their indices);
- ``save_checkpoint`` (every rank) writes the module's state dict and the optimizer's shard, and
  the rest of Lightning's checkpoint dict (loops, callbacks, schedulers, hyper-parameters) as the
  checkpoint's ``extra`` under ``"lightning"``;
- ``load_checkpoint`` of such a directory loads the module's weights and returns Lightning's dict
  with the loaded ``state_dict`` and, for the optimizer, a marker that ``load_optimizer_state_dict``
  resolves by reading each rank's shard (at any world size).
"""

from __future__ import annotations

import os
from typing import Any

import torch

import horovod.torch as hvd

__all__ = ["MARK", "is_sharded", "save", "load", "load_optimizer"]

MARK = "horovod_sharded_checkpoint"


def is_sharded(path: str) -> bool:
    """Whether ``path`` is a checkpoint directory written by ``hvd.checkpoint``."""
    if not os.path.isdir(path):
        return False
    try:
        hvd.checkpoint.latest(path)
    except (OSError, ValueError):
        return False
    return True


def save(checkpoint: dict[str, Any], path: str, module: torch.nn.Module,
         optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None, rank: int) -> None:
    """Write Lightning's ``checkpoint`` dict to the directory ``path``, each rank its part;
    collective. ``optimizer``: one, or the list of several (each one's state under its index)."""
    rest = dict(checkpoint)
    rest.pop("state_dict", None)  # written from ``module``, split across the ranks
    with_optimizer = rest.pop("optimizer_states", None) is not None  # absent: weights only
    if rank == 0 and os.path.isfile(path):
        os.remove(path)  # a single-file checkpoint of the same name
    hvd.checkpoint.save(path, model=module, optimizer=optimizer if with_optimizer else None,
                        extra={"lightning": rest})


def load(path: str, module: torch.nn.Module) -> dict[str, Any]:
    """Load the module's weights from the directory ``path`` and return Lightning's checkpoint
    dict (its ``optimizer_states`` a marker for ``load_optimizer``)."""
    extra = hvd.checkpoint.load(path, model=module)
    checkpoint = dict(extra.get("lightning") or {})
    if not checkpoint:
        raise ValueError(f"HorovodStrategy: {path!r} is an hvd.checkpoint directory without "
                         "Lightning's checkpoint data; load it with hvd.checkpoint.load")
    checkpoint["state_dict"] = module.state_dict()
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(hvd.checkpoint.latest(path)).read_metadata().state_dict_metadata
    if "optim.param_groups" in md:
        checkpoint["optimizer_states"] = [{MARK: path}]
    else:  # several optimizers (optim.<i>.param_groups): a marker for each
        count = sum(1 for k in md if k.startswith("optim.") and k.endswith(".param_groups"))
        if count:
            checkpoint["optimizer_states"] = [{MARK: path, "index": i} for i in range(count)]
    return checkpoint


def load_optimizer(checkpoint: dict[str, Any], module: torch.nn.Module,
                   optimizers: list[torch.optim.Optimizer]) -> bool:
    """Load the optimizer of a sharded checkpoint (each rank its shard); False if
    ``checkpoint`` is not one."""
    states = checkpoint.get("optimizer_states") or []
    if not (states and all(isinstance(st, dict) and MARK in st for st in states)):
        return False
    if len(optimizers) != len(states):
        raise RuntimeError(f"HorovodStrategy: the checkpoint {states[0][MARK]!r} holds the state of "
                           f"{len(states)} optimizer(s), this run has {len(optimizers)}: "
                           "configure_optimizers must return the optimizers it was saved with")
    several = "index" in states[0]  # saved as a list (hvd.checkpoint.save(optimizer=[...]))
    hvd.checkpoint.load(states[0][MARK], model=module, optimizer=optimizers if several else optimizers[0])
    return True
