"""The two protocols by which the torch integrations hold each other: ``GradientReducer`` (what an
optimizer composes to average its gradients across ranks) and ``ShardedStateful`` (an optimizer
whose state is split across ranks, as ``hvd.checkpoint`` reads and writes it).

Implementations:

- ``DenseReducer`` (``horovod/torch/_dense_reducer.py``): every rank keeps every averaged
  gradient; one allreduce per gradient (or group, or bundle), started by gradient hooks while
  backward runs. ``hvd.DistributedOptimizer`` and ``hvd.ZeroRedundancyOptimizer(stage=1)`` use it.
- ``ShardedGradients`` (``horovod/torch/_zero_grads.py``): ZeRO stage 2, each rank keeps only the
  averaged gradients of the parameters it owns (a reduce-scatter per bucket).
- ``FullyShardedReducer`` (``horovod/torch/_shard_reducer.py``, ``reducer_for(module)``): ZeRO stage
  3, the reduce-scatters that ``hvd.fully_shard``'s modules run in backward, seen from a plain
  optimizer over their shards.

An optimizer holds its reducer as the public attribute ``reducer`` (``opt.reducer``); the Lightning
strategy and the checkpoint code use only the members below, never an optimizer's private fields.

The contract, common to all of them:

- Gradient hooks are registered at construction (where reduction applies: more than one rank);
  ``remove_hooks()`` takes them off (a later optimizer over the same parameters, a benchmark) and
  ``register_hooks()`` puts them back.
- A step's gradients are averaged by the end of the ``backward()`` pass that completes
  ``backward_passes_per_step`` passes (as under DDP), so ``GradScaler.unscale_``, clipping and
  anything else that reads ``p.grad`` before ``step()`` sees the averages; ``synchronize()`` also
  does it explicitly (for a backward pass that produced no gradient on this rank, or outside
  autograd). ``pending()`` says whether reductions are in flight, or gradients held for one.
- ``synchronize_on_step`` is False inside ``skip_synchronize()``: the optimizer's ``step()`` then
  updates without synchronizing (after an explicit ``synchronize()``).
- ``check_idle()`` raises ``AssertionError`` if this step's gradients are in flight (what
  ``zero_grad()`` must not race with), and otherwise forgets a finished reduction whose step was
  skipped (a ``GradScaler`` that found inf/NaN).
- ``reset()`` drops this step's reductions and pass counters (a failed step, a reload).
- ``state_dict()`` / ``load_state_dict()``: the reducer's own state for checkpoints (a stateful
  compression's, such as PowerSGD's error feedback); ``{}`` where there is none.
- ``clip_grad_norm_(max_norm)``: clipping by the norm of the whole averaged gradient, whichever
  part of it each rank holds (what the Lightning strategy calls for ``gradient_clip_val``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

__all__ = ["GradientReducer", "ShardedStateful", "RowShard", "RowShardedStateful", "SkipSynchronize",
           "PassesPerStep", "reducer_of"]


@runtime_checkable
class GradientReducer(Protocol):
    """Averages an optimizer's gradients across the ranks of a process set (see the module
    docstring for the contract)."""

    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes accumulated locally before the gradients are averaged."""
        ...

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change ``backward_passes_per_step`` (between steps)."""
        ...

    def register_hooks(self) -> None:
        """Put the gradient hooks on the parameters (done at construction)."""
        ...

    def remove_hooks(self) -> None:
        """Take the gradient hooks off the parameters."""
        ...

    def pending(self) -> bool:
        """Whether this step's gradients are in flight or held for a reduction."""
        ...

    def synchronize(self) -> None:
        """Finish this step's reduction now (each implementation documents a repeated call)."""
        ...

    @property
    def synchronize_on_step(self) -> bool:
        """False inside ``skip_synchronize()``: the optimizer's ``step()`` does not synchronize."""
        ...

    def skip_synchronize(self) -> AbstractContextManager[None]:
        """A context in which the optimizer's ``step()`` does not synchronize."""
        ...

    def check_idle(self) -> None:
        """Raise ``AssertionError`` if this step's gradients are in flight (``zero_grad()``)."""
        ...

    def reset(self) -> None:
        """Drop this step's reductions and pass counters."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The reducer's own state for checkpoints (``{}`` when it has none)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``state_dict()`` returned."""
        ...

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> Any:
        """Clip this step's averaged gradients by the norm of the whole gradient (the same on
        every rank, combined across ranks where each holds part of it), as
        ``torch.nn.utils.clip_grad_norm_`` over the unsharded model; finishes a reduction still
        in flight first. Returns the norm (a tensor). Every rank of the process set calls it."""
        ...


@runtime_checkable
class ShardedStateful(Protocol):
    """An optimizer whose state is split across the ranks (as ``torch.distributed.checkpoint``'s
    ``Stateful``, for the per-rank part): each parameter's state lives on one rank. Parameters are
    numbered in ``param_groups`` order, as in a plain optimizer's ``state_dict()``.

    ``hvd.checkpoint.save`` writes each rank's ``local_state_dict()``; ``hvd.checkpoint.load``
    reads only the entries of ``owned_indices()`` and hands them to ``load_state_dict`` in the
    plain optimizer's format (a full state dict in which only this rank's entries are present).
    """

    @property
    def num_shards(self) -> int:
        """How many ranks the state is split across."""
        ...

    def owned_indices(self) -> list[int]:
        """The indices of the parameters whose state this rank holds."""
        ...

    def local_state_dict(self) -> dict[int, Any]:
        """This rank's part: ``{parameter index: that parameter's state}``."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict in the plain optimizer's format, keeping this rank's part."""
        ...


@dataclasses.dataclass(frozen=True)
class RowShard:
    """What a rank holds of one tensor split by rows: rows ``[lo, hi)`` (dimension 0) of a tensor
    of ``shape`` (a 0-d tensor counts as one row, held as a tensor of shape ``(hi - lo,)``)."""

    shape: tuple[int, ...]
    lo: int
    hi: int

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the part this rank holds."""
        return (self.hi - self.lo, *self.shape[1:])


@runtime_checkable
class RowShardedStateful(Protocol):
    """A module whose parameters are split by rows across the ranks (``hvd.fully_shard``): its
    ``state_dict()`` holds this rank's rows of each sharded parameter, under the unsharded
    model's names, and ``load_state_dict()`` takes them back.

    ``hvd.checkpoint.save`` writes each rank's rows as one chunk of the whole tensor (the
    checkpoint holds the unsharded model's keys and shapes); ``hvd.checkpoint.load`` reads each
    rank's rows at any world size, or whole tensors into an unsharded model. An optimizer over the
    shards (a plain torch optimizer) is saved alike: its per-element state (the tensors shaped
    as their shard) by rows, the rest (``step``) once.
    """

    @property
    def num_shards(self) -> int:
        """How many ranks the parameters are split across."""
        ...

    def row_shards(self) -> dict[str, RowShard]:
        """``{state-dict key: the rows this rank holds}`` for every sharded parameter (each name
        of a tied one)."""
        ...


def reducer_of(optimizer: Any) -> GradientReducer | None:
    """The ``GradientReducer`` an optimizer composes (``optimizer.reducer``), or None for an
    optimizer that averages nothing itself (a plain one, the Adasum delta optimizer)."""
    reducer = getattr(optimizer, "reducer", None)
    return reducer if isinstance(reducer, GradientReducer) else None


class PassesPerStep:
    """``backward_passes_per_step`` and its checked setter, as every reducer implements them;
    ``_passes_changed`` lets a reducer follow a change (its per-parameter counters)."""

    _passes = 1

    @property
    def backward_passes_per_step(self) -> int:
        return self._passes

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated locally before the reduction."""
        if passes <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self._passes = int(passes)
        self._passes_changed(self._passes)

    def _passes_changed(self, passes: int) -> None:
        """Called after ``set_backward_passes_per_step`` with the new count."""


class SkipSynchronize:
    """``synchronize_on_step`` and ``skip_synchronize()``, as both reducers implement them."""

    _should_synchronize = True

    @property
    def synchronize_on_step(self) -> bool:
        return self._should_synchronize

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Make the optimizer's ``step()`` skip synchronization (after an explicit
        ``synchronize()``)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True
