"""``DistributedOptimizer``: averages gradients across ranks while backward is still running.

A hook on every parameter (``register_post_accumulate_grad_hook``) starts an in-place allreduce of
``p.grad`` as soon as autograd has finished accumulating it, so communication of the last layers'
gradients overlaps the backward pass of the first layers. ``step()`` waits for all of them (and
for parameters whose gradient never came, which are reduced as zeros so every rank submits the same
set of names) and then runs the wrapped optimizer's update.

Where the engine holds the hooks' gradients until ``step()`` anyway (``tunables.overlap`` off),
the hooks of a backward pass only note their gradients, and one callback at the end of the pass
submits them together under one handle (``_collect``): each is still its own allreduce.

The hooks and the averaging are the optimizer's ``reducer``, a ``DenseReducer``
(``horovod/torch/_dense_reducer.py``, the ``GradientReducer`` protocol of
``horovod/torch/reducer.py``); this module builds the optimizer class around it.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from horovod.common.basics import size
from horovod.common.collectives import check_adasum
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.common.types import Adasum, Average
from horovod.torch._adasum_optimizer import DistributedAdasumOptimizer
from horovod.torch._dense_reducer import COMPRESSION_KEY, DenseReducer, parameter_names, validate_whole_step
from horovod.torch.compression import Compression

__all__ = ["DistributedOptimizer"]

def _unhooked(fn: Any) -> Any:
    # torch wraps every Optimizer subclass's step() once to run step hooks; our subclass's step()
    # is wrapped too, so call the base step without its wrapper or the hooks would run twice.
    return fn.__wrapped__ if getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__") else fn


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixin placed before the wrapped optimizer's class in a new class of the same name; the
    averaging itself is its ``reducer``'s (a ``DenseReducer``, see ``horovod/torch/reducer.py``)."""

    def __init__(self, params: Any, named_parameters: Any, compression: Any,
                 backward_passes_per_step: int, op: int, gradient_predivide_factor: float,
                 groups: Any, sparse_as_dense: bool, process_set: ProcessSet) -> None:
        self._hvd_base: Any = type(self).__mro__[2]  # [new class, this mixin, wrapped optimizer class]
        self._hvd_base.__init__(self, params)  # type: ignore[misc]  # the wrapped class, known at run time
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        # upstream's attribute name, read by user code that logs or filters gradients by name
        self._parameter_names = parameter_names(self.param_groups, named_parameters)
        self.reducer = DenseReducer(self.param_groups, self._parameter_names,
                                    compression, backward_passes_per_step, op,
                                    gradient_predivide_factor, groups, sparse_as_dense, process_set)

    @property
    def backward_passes_per_step(self) -> int:
        return self.reducer.backward_passes_per_step

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated locally before each allreduce."""
        self.reducer.set_backward_passes_per_step(passes)

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce and write the averaged gradients into ``p.grad``.

        Parameters whose allreduce has not started (no gradient in this backward, or fewer than
        ``backward_passes_per_step`` passes so far) are reduced now, in parameter order, so that
        every rank submits the same names. After a backward pass that already averaged the
        gradients (at its end) there is nothing left to wait for.

        Raises:
            RuntimeError: inside ``no_sync()``.
        """
        self.reducer.synchronize()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally: backward passes inside the context start no allreduce;
        the first backward pass after it (or ``step()``) averages everything accumulated, one
        allreduce per gradient. ``step()`` and ``synchronize()`` inside the context raise.

        Every rank must run the same passes inside and outside the context. Compared with
        ``backward_passes_per_step`` (a fixed count chosen up front), the context decides per
        pass, as DDP's ``model.no_sync()``."""
        return self.reducer.no_sync()

    def skip_synchronize(self) -> contextlib.AbstractContextManager[None]:
        """Make ``step()`` skip synchronization (after an explicit ``synchronize()``)."""
        return self.reducer.skip_synchronize()

    def step(self, closure: Any = None) -> Any:
        """Synchronize gradients (unless inside ``skip_synchronize()``, or already done at the end
        of backward), then update parameters.

        Raises:
            RuntimeError: inside ``no_sync()`` (the gradients would not be averaged).
        """
        self.reducer.before_step()
        try:
            return self.local_step(closure)
        finally:
            self.reducer.after_step()

    def local_step(self, closure: Any = None) -> Any:
        """The wrapped optimizer's update alone: no synchronization, no step hooks."""
        base_step = _unhooked(self._hvd_base.step)
        return base_step(self) if closure is None else base_step(self, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients; forbidden while gradient allreduces are in flight.

        Raises:
            AssertionError: called after ``backward()`` but before ``step()``/``synchronize()``.
        """
        self.reducer.check_idle()
        return self._hvd_base.zero_grad(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict; with a stateful compression (PowerSGD) its state
        too, under ``"horovod_compression"`` (so checkpoints and elastic commits carry it)."""
        sd = self._hvd_base.state_dict(self)
        sd.update(self.reducer.state_dict())
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load optimizer state (and a stateful compression's); pending allreduces are dropped and
        pass counters reset."""
        if COMPRESSION_KEY in state_dict:
            state_dict = dict(state_dict)
            self.reducer.load_state_dict({COMPRESSION_KEY: state_dict.pop(COMPRESSION_KEY)})
        self.reducer.reset()
        return self._hvd_base.load_state_dict(self, state_dict)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,  # noqa: N802
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: int = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that gradients are averaged across ranks before each update.

    Returns an instance of a new class with the same name as ``optimizer``'s class, built on
    ``optimizer.param_groups`` (the state of ``optimizer`` itself is not copied). Allreduces start
    from gradient hooks during ``backward()``; ``step()`` waits for them. Every rank of
    ``process_set`` must run the same number of backward/step calls.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        named_parameters: ``model.named_parameters()``; names become the allreduce names.
        compression: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16`` (one
            tensor at a time), or a ``StatefulCompressor`` such as ``hvd.PowerSGD(rank=2)`` that
            reduces a whole step's gradients at once (Average only; docs/compression.md).
        backward_passes_per_step: backward passes accumulated locally before one allreduce.
        op: ``Average``, ``Sum`` or ``Adasum`` (with more than one rank: upstream's delta
            optimizer, see ``horovod.torch._adasum_optimizer``; world size a power of two).
        gradient_predivide_factor: divide by this before the sum and multiply after (Average only).
        num_groups: deprecated; use ``groups``.
        groups: an int k (params split into k fused groups) or a list of lists of parameters.
        sparse_as_dense: reduce sparse gradients as dense tensors instead of by allgather.
        process_set: the ranks whose gradients are averaged; other ranks train locally.

    Raises:
        ValueError: bad ``named_parameters``, ``groups``, ``backward_passes_per_step`` or
            ``gradient_predivide_factor``.
        NotImplementedError: ``op=Adasum`` with a non-global process set or a world size that is
            not a power of two.
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v1.0.",
                      DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    validate_whole_step(compression, op, groups, gradient_predivide_factor)
    if op == Adasum and size() > 1:  # upstream's delta optimizer (one rank: the plain wrapper)
        check_adasum(process_set.process_set_id, "float32", "DistributedOptimizer")
        cls = type(optimizer.__class__.__name__, (DistributedAdasumOptimizer, optimizer.__class__), {})
        names = parameter_names(optimizer.param_groups, named_parameters)
        return cls(optimizer.param_groups, names, compression, backward_passes_per_step)
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set)
