"""``TorchState``: the model, optimizer, LR scheduler, sampler and plain values of an elastic job.

``commit()`` copies model and optimizer tensors into buffers kept from the previous commit (no new
allocation once shapes are known); ``restore()`` copies them back (never aliasing the saved
copy, so restoring twice gives the same state); ``sync()`` broadcasts rank 0's state. The
optimizer state travels as one object (structure included), so a new worker whose optimizer has
no state yet receives it whole instead of waiting in a broadcast that the others never join
(upstream #2652).

Sharded states (a ``hvd.fully_shard`` model, the plain optimizer over its shards, a
``ZeroRedundancyOptimizer``) are committed sharded by default (``sharded_handlers.py``): each rank
keeps its own part and a replica of one other rank's, about 2/N of the whole; ``replicas="all"``
keeps the whole committed state on every rank instead (the ``Whole*`` handlers below).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from horovod.common.basics import rank
from horovod.common.elastic import ObjectState
from horovod.common.elastic.state import Committed
from horovod.torch.elastic.sampler import ElasticSampler
from horovod.torch.elastic.sharded_handlers import (
    FullyShardedModelStateHandler,
    FullyShardedOptimizerStateHandler,
    ZeroOptimizerStateHandler,
)
from horovod.torch.fully_shard import (
    FullyShardedModule,
    check_same_modules,
    full_optim_state_dict,
    groups_of_params,
    is_shard,
    load_full_optim_state_dict,
    relayout,
)
from horovod.torch.functions import broadcast_object, broadcast_parameters
from horovod.torch.zero import ZeroRedundancyOptimizer

__all__ = ["TorchState", "StateHandler", "ModelStateHandler", "OptimizerStateHandler",
           "ZeroOptimizerStateHandler", "FullyShardedModelStateHandler",
           "FullyShardedOptimizerStateHandler", "WholeZeroOptimizerStateHandler",
           "WholeFullyShardedModelStateHandler", "WholeFullyShardedOptimizerStateHandler",
           "LRSchedulerStateHandler", "SamplerStateHandler", "get_handler_registry",
           "set_handler_registry"]


def _copy_into(prev: Any, new: Any) -> Any:
    """A copy of ``new`` (nested dicts/lists/tensors) that reuses ``prev``'s tensors in place."""
    if isinstance(new, torch.Tensor):
        if (isinstance(prev, torch.Tensor) and prev.shape == new.shape
                and prev.dtype == new.dtype and prev.device == new.device):
            prev.copy_(new)
            return prev
        return new.detach().clone()
    if isinstance(new, dict):
        prev_d = prev if isinstance(prev, dict) else {}
        return {k: _copy_into(prev_d.get(k), v) for k, v in new.items()}
    if isinstance(new, (list, tuple)):
        prev_l = list(prev) if isinstance(prev, (list, tuple)) and len(prev) == len(new) else \
            [None] * len(new)
        out = [_copy_into(p, v) for p, v in zip(prev_l, new)]
        return out if isinstance(new, list) else tuple(out)
    return copy.deepcopy(new)


class StateHandler(Committed):
    """Keeps one object's committed state: ``save``, ``restore``, ``sync``."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()

    def committed_bytes(self) -> int:
        """The bytes of the tensors this rank keeps of the last commit."""
        return _tensor_bytes(getattr(self, "_saved", None))


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


class _SavedAtOnce(StateHandler):
    """A handler whose first copy is made when it is created."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self._saved: Any = None
        self.save()


class ModelStateHandler(_SavedAtOnce):
    def save(self) -> None:
        with torch.no_grad():
            self._saved = _copy_into(self._saved, dict(self.value.state_dict()))

    def restore(self) -> None:
        with torch.no_grad():
            self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_SavedAtOnce):
    def save(self) -> None:
        with torch.no_grad():
            self._saved = _copy_into(self._saved, self.value.state_dict())

    def restore(self) -> None:
        # load_state_dict keeps the given tensors as the optimizer's state: give it a copy.
        self.value.load_state_dict(_copy_into(None, self._saved))

    def sync(self) -> None:
        state = broadcast_object(self.value.state_dict() if rank() == 0 else None, root_rank=0,
                                 name="elastic.optimizer_state")
        if rank() != 0:
            self.value.load_state_dict(state)


class WholeZeroOptimizerStateHandler(StateHandler):
    """``TorchState(replicas="all")``'s handler of a ``ZeroRedundancyOptimizer``: each commit
    gathers the whole state on every rank (so it survives the loss of any ranks but one); after a
    reset the optimizer is re-partitioned over the new world and each rank loads its new shard
    from that copy. Memory: the committed copy is the whole optimizer state, on every rank (the
    default handler, ``ZeroOptimizerStateHandler``, keeps about 2/N of it).

    The commit is collective (every rank commits together); the first copy is made by the first
    ``sync``, so that a worker joining a running job does not wait in a gather the others never
    make.
    """

    def __init__(self, optimizer: Any) -> None:
        super().__init__(optimizer)
        self._saved: Any = None

    def save(self) -> None:
        with torch.no_grad():
            self._saved = _copy_into(self._saved, self.value.full_state_dict(None))

    def restore(self) -> None:
        if self._saved is not None:
            self.value.load_state_dict(_copy_into(None, self._saved))

    def reset(self) -> None:
        """The world changed: re-partition, and load the new shard from the committed copy."""
        self.value.repartition()
        self.restore()

    def sync(self) -> None:
        has = broadcast_object(self._saved is not None if rank() == 0 else None, root_rank=0,
                               name="elastic.zero_state.has")
        ps = self.value.process_set
        if (self.value.rank, self.value.world) != (ps.rank() or 0, ps.size() or 1):
            self.value.repartition()  # drops the local state: only when the world changed
        if has:
            self._saved = broadcast_object(self._saved if rank() == 0 else None, root_rank=0,
                                           name="elastic.zero_state")
            self.restore()
        else:  # no commit yet: the live shards, gathered
            self.save()


class WholeFullyShardedModelStateHandler(StateHandler):
    """``TorchState(replicas="all")``'s handler of a fully sharded model (``hvd.fully_shard``):
    each commit gathers the whole model on every rank (``full_state_dict``: it survives the loss
    of any ranks but one); after a reset the shards are laid out over the new world
    (``relayout``) and each rank takes its new rows from that copy. Memory: the committed copy is
    the whole model, on every rank (the default handler, ``FullyShardedModelStateHandler``, keeps
    about 2/N of it). Commits are collective; the first copy is made by the first ``sync``, which
    also checks that every rank (a worker that joined included) wrapped the same modules."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self._saved: Any = None

    def save(self) -> None:
        with torch.no_grad():
            self._saved = _copy_into(self._saved, self.value.full_state_dict(None))

    def restore(self) -> None:
        relayout(self._modules())
        if self._saved is not None:
            with torch.no_grad():
                self.value.load_full_state_dict(self._saved)

    def _modules(self) -> list[Any]:
        return [m for m in self.value.modules() if isinstance(m, FullyShardedModule)]

    def reset(self) -> None:
        """The world changed: lay the shards out over it and load them from the commit."""
        self.restore()

    def sync(self) -> None:
        check_same_modules(self.value)
        relayout(self._modules())
        has = broadcast_object(self._saved is not None if rank() == 0 else None, root_rank=0,
                               name="elastic.fully_shard.has")
        if has:
            self._saved = broadcast_object(self._saved if rank() == 0 else None, root_rank=0,
                                           name="elastic.fully_shard")
            self.restore()
        else:  # no commit yet: the live rows, gathered
            self.save()


class WholeFullyShardedOptimizerStateHandler(StateHandler):
    """``TorchState(replicas="all")``'s handler of a plain torch optimizer over a fully sharded
    model's shards: as ``WholeFullyShardedModelStateHandler``, with the optimizer's state
    gathered whole at each commit (``full_optim_state_dict``) and each rank's rows loaded from it
    after a reset."""

    def __init__(self, optimizer: Any) -> None:
        super().__init__(optimizer)
        self._saved: Any = None

    def _groups(self) -> list[Any]:
        return groups_of_params(p for g in self.value.param_groups for p in g["params"])

    def save(self) -> None:
        with torch.no_grad():
            self._saved = _copy_into(self._saved, full_optim_state_dict(None, self.value, None))

    def restore(self) -> None:
        relayout(self._groups())
        if self._saved is not None:
            load_full_optim_state_dict(None, self.value, _copy_into(None, self._saved))

    def reset(self) -> None:
        self.restore()

    def sync(self) -> None:
        relayout(self._groups())
        has = broadcast_object(self._saved is not None if rank() == 0 else None, root_rank=0,
                               name="elastic.fully_shard_optimizer.has")
        if has:
            self._saved = broadcast_object(self._saved if rank() == 0 else None, root_rank=0,
                                           name="elastic.fully_shard_optimizer")
            self.restore()
        else:
            self.save()


class _StateDictHandler(_SavedAtOnce):
    """Keeps a deep copy of ``value.state_dict()``; syncs it from rank 0 by object broadcast."""

    sync_name = ""

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0,
                                                    name=self.sync_name))


class LRSchedulerStateHandler(_StateDictHandler):
    sync_name = "elastic.lr_scheduler_state"


class SamplerStateHandler(_StateDictHandler):
    sync_name = "elastic.sampler_state"


_handler_registry: list[tuple[type, type[Any]]] = [
    (FullyShardedModule, FullyShardedModelStateHandler),  # before every other module
    (torch.nn.Module, ModelStateHandler),
    (ZeroRedundancyOptimizer, ZeroOptimizerStateHandler),  # before every other optimizer
    (torch.optim.Optimizer, OptimizerStateHandler),
    (torch.optim.lr_scheduler.LRScheduler, LRSchedulerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list[tuple[type, type[Any]]]:
    return _handler_registry


def set_handler_registry(registry: list[tuple[type, type[Any]]]) -> None:
    global _handler_registry
    _handler_registry = registry


# replicas="all": the handlers that keep the whole committed state on every rank
_WHOLE: dict[type, type] = {
    FullyShardedModelStateHandler: WholeFullyShardedModelStateHandler,
    FullyShardedOptimizerStateHandler: WholeFullyShardedOptimizerStateHandler,
    ZeroOptimizerStateHandler: WholeZeroOptimizerStateHandler,
}
REPLICAS = ("buddy", "all")


def _handler_for(value: Any, replicas: str = "buddy") -> Any:
    cls: Any = None
    if isinstance(value, torch.optim.Optimizer) and not isinstance(value, ZeroRedundancyOptimizer) and any(
            is_shard(p) for g in value.param_groups for p in g["params"]):
        cls = FullyShardedOptimizerStateHandler  # a plain optimizer over shards
    else:
        cls = next((c for kind, c in _handler_registry if isinstance(value, kind)), None)
    if cls is None:
        return None
    if replicas == "all":
        cls = _WHOLE.get(cls, cls)
    return cls(value)


class TorchState(ObjectState):
    """State of a PyTorch elastic job.

    Args:
        model: a ``torch.nn.Module`` (optional).
        optimizer: a ``torch.optim.Optimizer``, ``DistributedOptimizer`` or
            ``ZeroRedundancyOptimizer`` (optional; its shards are re-partitioned after a reset).
            A model wrapped by ``hvd.fully_shard`` and a plain optimizer over its shards are
            laid out again over the new world after a reset (each rank's new rows of the
            committed parameters and optimizer state).
        replicas: how sharded states (a fully sharded model, its optimizer, a
            ``ZeroRedundancyOptimizer``) are committed. ``"buddy"`` (default): each rank keeps
            the committed copy of its own part plus a replica of the next rank's on a ring that
            alternates hosts, about 2/N of the whole per rank; a reset survives the loss of any
            ranks of which no two are neighbours on that ring (otherwise every rank raises
            ``hvd.elastic.LostRowsError`` naming the old ranks whose parts are lost). ``"all"``: every rank
            keeps the whole committed state (gathered at each commit; survives the loss of all
            ranks but one, at the memory of the whole model on every rank).
        kwargs: more models, optimizers, LR schedulers, ``ElasticSampler`` objects, or plain
            values (epoch, batch...), all exposed as attributes.
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, *, replicas: str = "buddy",
                 **kwargs: Any) -> None:
        if replicas not in REPLICAS:
            raise ValueError(f"hvd.elastic.TorchState: replicas={replicas!r}; use 'buddy' (each rank "
                             "keeps its part of a sharded state and a replica of one other rank's) or "
                             "'all' (every rank keeps the whole committed state)")
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, Any] = {}
        plain: dict[str, Any] = {}
        for k, v in kwargs.items():
            h = _handler_for(v, replicas)
            if h is not None:
                handlers[k] = h
            else:
                plain[k] = v
        self._handlers = handlers
        for name, handler in handlers.items():
            setattr(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self) -> None:
        """After a reset (before ``sync``): handlers whose state depends on the world size (a
        ``ZeroRedundancyOptimizer``'s shards) adjust to the new one."""
        for handler in self._handlers.values():
            reset = getattr(handler, "reset", None)
            if reset is not None:
                reset()
        super().reset()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers")
        if handlers is not None and name in handlers and hasattr(self, name):
            handlers[name].set_value(value)
        super().__setattr__(name, value)
