"""``DistributedOptimizer(op=hvd.Adasum)``: upstream's delta optimizer.

Adasum combines *updates*, not gradients: as soon as a parameter's gradient has been accumulated
``backward_passes_per_step`` times, its hook runs the wrapped optimizer's step for that parameter
alone, takes the change it made (``delta = new - start``) and starts an in-place Adasum allreduce
of the delta (optionally fp16-compressed). ``step()`` waits for every delta and sets each
parameter to ``start + adasum(deltas)``. As upstream: ``synchronize()`` does nothing,
``skip_synchronize()`` raises, ``gradient_predivide_factor`` is rejected (it is Average-only) and
only the global process set is supported. The learning rate should generally not be scaled by the
number of ranks (Adasum adds orthogonal updates and averages parallel ones).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from horovod.common.types import Adasum
from horovod.torch._autograd import GradHooks
from horovod.torch.mpi_ops import allreduce_async_, synchronize

__all__ = ["DistributedAdasumOptimizer"]

_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call to "
                "step(). Increase backward_passes_per_step to accumulate gradients locally.")
_ZERO_GRAD = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
              "optimizer.synchronize(). This is prohibited as it can cause a race condition.")


def _unhooked(fn: Any) -> Any:
    return fn.__wrapped__ if getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__") else fn


class DistributedAdasumOptimizer(torch.optim.Optimizer):
    """Mixin placed before the wrapped optimizer's class in a new class of the same name."""

    def __init__(self, params: Any, parameter_names: dict[torch.Tensor, str], compression: Any,
                 backward_passes_per_step: int) -> None:
        self._hvd_base: Any = type(self).__mro__[2]  # [new class, this mixin, wrapped optimizer class]
        self._hvd_base.__init__(self, params)  # type: ignore[misc]  # the wrapped class, known at run time
        self._compression = compression
        self._parameter_names = parameter_names
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {p: backward_passes_per_step for p in parameter_names}
        self._handles: dict[torch.Tensor, tuple[Any, Any]] = {}
        self._requires_update: set[torch.Tensor] = set()
        self._starting_models = {p: torch.zeros_like(p, requires_grad=False) for p in parameter_names}
        self._hooks = GradHooks()
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._requires_update.add(p)
                    self._hooks.add(p, self._make_hook(p))

    def remove_hooks(self) -> None:
        """Take the gradient hooks off the parameters (a later optimizer over them)."""
        self._hooks.remove()

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _delta_allreduce_async(self, p: torch.Tensor) -> tuple[Any, Any]:
        """Step the wrapped optimizer on ``p`` alone, turn ``p`` into its delta, start its Adasum."""
        start = self._starting_models[p]
        stashed = [group["params"] for group in self.param_groups]
        for group in self.param_groups:
            group["params"] = [p] if any(p is v for v in group["params"]) else []
        try:
            with torch.no_grad():
                start.copy_(p)
                _unhooked(self._hvd_base.step)(self)
                p.sub_(start)
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params
        compressed, ctx = self._compression.compress(p.data)
        handle = allreduce_async_(compressed, name=self._parameter_names.get(p), op=Adasum)
        return handle, ctx

    def _make_hook(self, p: torch.Tensor) -> Any:
        def hook(_param: torch.Tensor) -> None:
            if self._allreduce_delay[p] <= 0:
                raise AssertionError(_MANY_PASSES)
            handle, ctx = None, None
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                handle, ctx = self._delta_allreduce_async(p)
            self._handles[p] = (handle, ctx)
        return hook

    def synchronize(self) -> None:
        """Nothing to do: ``step()`` waits for the deltas (as upstream)."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover

    def step(self, closure: Any = None) -> Any:
        """Wait for every parameter's Adasum-reduced delta and apply it to the saved start point."""
        loss = closure() if closure is not None else None
        for p in self._requires_update - set(self._handles):
            self._handles[p] = self._delta_allreduce_async(p)
        for p, (handle, ctx) in list(self._handles.items()):
            if handle is None:  # step() before backward_passes_per_step passes: reduce now
                handle, ctx = self._delta_allreduce_async(p)
            delta = self._compression.decompress(synchronize(handle), ctx)
            start = self._starting_models[p]
            with torch.no_grad():
                start.add_(delta)
                p.copy_(start)
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._handles.clear()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise AssertionError(_ZERO_GRAD)
        return self._hvd_base.zero_grad(self, set_to_none)
