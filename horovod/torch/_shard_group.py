"""The state of one module that ``hvd.fully_shard`` wrapped (a ``ShardGroup``): the parameters it
manages (those of its subtree that no nested wrapped module manages), taken and checked at
``collect()``, and the iteration state that the root group keeps for every group under it.

What acts on this state lives beside it: the allgathers, reduce-scatters and their buffers in
``_shard_collectives.py``, the forward and backward hooks in ``_shard_hooks.py``, the layout over
another world size in ``_shard_relayout.py``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from horovod.common.process_sets import ProcessSet
from horovod.torch._shard_checks import allgather_object, describe, raise_on_difference
from horovod.torch._shard_params import GROUPS, SHARD_NAMES, SHARDED_AS, ShardedParam, flatten_shards

if TYPE_CHECKING:
    from horovod.torch.fully_shard import MixedPrecisionPolicy

__all__ = ["ShardGroup", "groups_in"]


class ShardGroup:
    """The state of one wrapped module."""

    def __init__(self, module: torch.nn.Module, reshard_after_forward: bool, process_set: ProcessSet,
                 mp: MixedPrecisionPolicy, compression: Any, index: int) -> None:
        self.module, self.process_set, self.mp, self.compression = module, process_set, mp, compression
        self.reshard_after_forward = reshard_after_forward
        self.index = index
        self.n = process_set.size() or 1
        self.r = process_set.rank() or 0
        self.owner: ShardGroup | None = None  # the enclosing wrapped module's group, once wrapped
        self.requires_sync = True
        # after freeing a module's buffers on CPU, give the allocator's free pages back (glibc)
        self.release_memory = os.environ.get("HOROVOD_FULLY_SHARD_RELEASE_MEMORY", "1") != "0"
        self.release_slack = 0        # (root) growth of resident free memory tolerated, bytes
        self.released_idle = 1 << 62  # (root) the least resident free memory since the last release
        # iteration state (kept on the root group)
        self.order: list[ShardGroup] = []
        self.prev_order: list[ShardGroup] = []
        self.pending: list[tuple[ShardGroup, int, Any, torch.Tensor | None]] = []
        self.spare: list[torch.Tensor] = []  # reduce-scatter input buffers, reused (``take_buffer``)
        # (root) the unsharded parameters that show an allgather output, by its storage's address,
        # and the saved-tensor hooks that keep autograd's saved views of them by parameter, not by
        # storage (``_shard_hooks``)
        self.borrowed: dict[int, tuple[ShardGroup, ShardedParam]] = {}
        self.saved_hooks: tuple[Any, Any] | None = None
        self.callback_queued = False
        self.in_forward = False
        self.open = False          # an iteration has begun and its backward has not ended
        self.grad_pending = False  # a forward of this iteration made outputs a backward will use
        self.iteration = 0
        self.seq_iteration = -1
        self.seq: dict[str, int] = {}
        # this group's state
        self.gather: int | None = None
        # the iteration in which a forward of this module ran under saved-tensor hooks other than
        # ours (activation checkpointing, offloading): its parameters then keep their own storage
        # until that iteration's backward is done
        self.own_storage_iteration = -1
        self.saving: Any = None  # our saved-tensor hooks, pushed for this module's forward
        # the parameters whose gradients the reduce-scatter takes as they are ([]: none, the
        # packed buffer; None: not decided yet; ``_shard_collectives._direct_params``)
        self.direct: list[ShardedParam] | None = None
        self.unsharded = False
        self.accumulated: set[int] = set()
        self.params: list[ShardedParam] = []
        self.segment = 0
        self.flat: torch.Tensor | None = None
        self.n_grad = 0
        self.desc: list[Any] = []  # what collect() checks every rank agrees on

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
                if p in SHARD_NAMES:
                    # a shard of a nested group: must be registered inside that group's module only
                    inner = _group_of_shard(module, p)
                    if inner is None or not any(m is mod for m in inner.module.modules()):
                        raise ValueError(
                            f"hvd.fully_shard: rank {self.r}: parameter {fqn} of {type(module).__name__} "
                            f"is also a parameter of a nested fully sharded module ({SHARD_NAMES[p]}); "
                            "a parameter shared between wrapped modules must be wrapped with their "
                            "common ancestor (wrap the outer module only)")
                    continue
                if p in SHARDED_AS:  # the original of a parameter sharded earlier
                    raise ValueError(
                        f"hvd.fully_shard: rank {self.r}: parameter {fqn} of {type(module).__name__} is "
                        f"tied to {SHARDED_AS[p]}, which an earlier fully_shard call sharded; a parameter "
                        "shared between modules must be wrapped with their common ancestor (wrap the "
                        "outer module only)")
                owners.setdefault(id(p), []).append((mod, pname))
                first.setdefault(id(p), (fqn, p))
        named = list(first.values())
        # every rank of the set must wrap the same module with the same parameters
        self.desc = describe(module, [(n, p) for n, p in named])
        # an elastic worker may join a running job, whose ranks wrapped their modules long ago:
        # the check is made by hvd.elastic.TorchState's sync (check_same_modules), with them
        if os.environ.get("HOROVOD_ELASTIC") != "1":
            raise_on_difference([allgather_object(self.desc, self.process_set)], [self.index])
        devices = {p.device.type for _, p in named}
        if len(devices) > 1:
            raise ValueError(f"hvd.fully_shard: rank {self.r}: {type(module).__name__} has parameters "
                             f"on different devices {sorted(devices)}; move the module to one device first")
        offset = 0
        for fqn, p in named:
            if not p.is_floating_point():
                raise ValueError(f"hvd.fully_shard: rank {self.r}: parameter {fqn} has dtype {p.dtype}; "
                                 "only floating point parameters can be sharded")
            prm = ShardedParam(fqn, owners[id(p)], p, self.n, self.r, self.mp.param_dtype or p.dtype, offset)
            offset += prm.seg
            prm.use(prm.shard)
            SHARDED_AS[p] = f"{fqn} of {type(module).__name__}"
            self.params.append(prm)
        self.segment = offset
        self.flat = flatten_shards(self.params, offset)
        self.n_grad = sum(1 for q in self.params if q.unsharded.requires_grad)

    def keeps_storage(self) -> bool:
        """Whether this iteration's gathers copy into the parameters' own storages (see
        ``own_storage_iteration``) rather than showing the allgather's output."""
        return self.own_storage_iteration == self.root().iteration

    def root(self) -> ShardGroup:
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


def groups_in(module: torch.nn.Module) -> list[ShardGroup]:
    """The groups of the wrapped modules in ``module``'s subtree (itself included)."""
    return [GROUPS[m] for m in module.modules() if m in GROUPS]


def _group_of_shard(module: torch.nn.Module, p: torch.Tensor) -> ShardGroup | None:
    for m in module.modules():
        g = GROUPS.get(m)
        if g is not None and any(q.shard is p for q in g.params):
            return g
    return None
