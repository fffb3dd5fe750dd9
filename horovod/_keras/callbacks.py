"""Keras callback implementations shared by ``horovod.tensorflow.keras`` and ``horovod.keras``.

Each public callback class is ``class X(XImpl, <keras>.callbacks.Callback)`` in the binding module,
so the same logic serves Keras 3 and Keras 2 (tf_keras).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from horovod._keras.helpers import get_lr, set_lr, uses_tensorflow
from horovod._keras.optimizer import disable_jit_for, is_distributed, optimizer_backend
from horovod.common import basics as _basics
from horovod.common import collectives as C
from horovod.common.types import ReduceOp

__all__ = ["BroadcastGlobalVariablesCallbackImpl", "MetricAverageCallbackImpl",
           "LearningRateScheduleCallbackImpl", "LearningRateWarmupCallbackImpl", "fix_jit"]

log = logging.getLogger("horovod")


def fix_jit(model: Any) -> None:
    """If the model would XLA-compile a step that runs Horovod ops, recompile its train function."""
    opt = getattr(model, "optimizer", None)
    if opt is None or not is_distributed(opt) or optimizer_backend(opt) != "tensorflow":
        return
    if disable_jit_for(model) and hasattr(model, "make_train_function"):
        model.make_train_function(force=True)


def _broadcast_keras_variables(variables: list[Any], root_rank: int) -> None:
    """Broadcast Keras variables of any backend through NumPy: one grouped broadcast per dtype."""
    values = [np.array(v.numpy(), order="C", copy=True) for v in variables]
    groups: dict[str, list[int]] = {}
    for i, val in enumerate(values):
        groups.setdefault(val.dtype.name, []).append(i)
    for dtype, idx in sorted(groups.items()):
        C.broadcast_async([values[i] for i in idx], root_rank, name=f"BroadcastGlobalVariables.{dtype}",
                          inplace=True, grouped=True, wake=False).wait()
    for v, val in zip(variables, values):
        v.assign(val)


def _optimizer_variables(opt: Any) -> list[Any]:
    v = opt.variables
    return list(v() if callable(v) else v)


class _CallbackState:
    """What the implementations read from the class they are mixed into: ``keras_backend`` (set by
    the binding: ``keras.backend`` of the Keras it serves) and Keras's ``Callback`` state
    (``set_model``, ``set_params``)."""

    keras_backend: Any
    model: Any
    params: dict[str, Any]


class BroadcastGlobalVariablesCallbackImpl(_CallbackState):
    """After the first batch, broadcast model and optimizer variables from ``root_rank``."""

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local: list[Any] = []
        for v in (local_variables or []) if isinstance(local_variables, list | tuple) else (
                [local_variables] if local_variables is not None else []):
            if not hasattr(v, "assign"):
                raise ValueError("local_variables must be a list of tf.Variable, got "
                                 f"{type(v).__name__}")
            self._local.append(v)

    def on_train_begin(self, logs: Any = None) -> None:
        fix_jit(self.model)

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.broadcast_done:
            return

        if not uses_tensorflow(self.keras_backend):  # Keras 3 on torch or JAX (self.model syncs JAX's state first)
            local = {id(v) for v in self._local}
            model = self.model
            opt = model.optimizer
            _broadcast_keras_variables(
                [v for v in model.weights if id(v) not in local]
                + (_optimizer_variables(opt) if opt is not None else []), self.root_rank)
            self.broadcast_done = True
            return
        import tensorflow as tf

        import horovod.tensorflow as hvd_tf
        from horovod.tensorflow._grads import _var_key

        local_keys = {_var_key(v) for v in self._local}
        with tf.device(self.device):
            if tf.executing_eagerly():
                model_vars = [v for v in self.model.weights if _var_key(v) not in local_keys]
                opt = self.model.optimizer
                opt_vars = _optimizer_variables(opt) if opt is not None else []
                hvd_tf.broadcast_variables(model_vars + opt_vars, root_rank=self.root_rank)
            else:
                bcast = hvd_tf.broadcast_global_variables(self.root_rank)
                tf.compat.v1.keras.backend.get_session().run(bcast)
        self.broadcast_done = True


class MetricAverageCallbackImpl(_CallbackState):
    """At the end of every epoch, replace each value in ``logs`` by its average over all ranks."""

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_train_begin(self, logs: Any = None) -> None:
        fix_jit(self.model)

    def _average_metrics_in_place(self, logs: Any) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if _is_number(v))
        if not keys:
            return
        values = np.array([float(np.asarray(logs[k])) for k in keys], dtype=np.float64)
        # One request for all metrics; sorted names keep every rank's vector in the same order.
        out = C.allreduce_async([values], name="MetricAverageCallback." + ",".join(keys),
                                op=ReduceOp.AVERAGE).wait()[0]
        for k, v in zip(keys, out.tolist()):
            logs[k] = v

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._average_metrics_in_place(logs)


def _is_number(v: Any) -> bool:
    try:
        return np.asarray(v).size == 1 and float(np.asarray(v)) is not None
    except (TypeError, ValueError):
        return False


class LearningRateScheduleCallbackImpl(_CallbackState):
    """Set ``lr = initial_lr * multiplier(epoch)`` within ``[start_epoch, end_epoch)``."""

    def __init__(self, initial_lr: float, multiplier: Any, start_epoch: int = 0, end_epoch: int | None = None,
                 staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None) -> None:
        super().__init__()
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.initial_lr = initial_lr
        self.restore_momentum: Any = None
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch: int | None = None
        if not callable(multiplier):
            self.staircase = True
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)
        else:
            self.multiplier = multiplier
        if self.initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")

    def _steps(self) -> int:
        """``steps_per_epoch``, detected from the training's parameters when it was not given."""
        if not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()
        return self.steps_per_epoch

    def _autodetect_steps_per_epoch(self) -> int:
        params = getattr(self, "params", None) or {}
        if params.get("steps"):
            return int(params["steps"])
        if params.get("samples") and params.get("batch_size"):
            return int(params["samples"]) // int(params["batch_size"])
        raise ValueError("Could not autodetect the number of steps per epoch. Please specify the "
                         f"steps_per_epoch parameter to the {type(self).__name__}().")

    def _adjust_learning_rate(self, epoch: float) -> None:
        opt = self.model.optimizer
        old_lr = get_lr(opt)
        new_lr = self.initial_lr * self.multiplier(epoch)
        set_lr(opt, new_lr)
        momentum = getattr(opt, "momentum", None)
        if self.momentum_correction and momentum is not None and hasattr(momentum, "assign") and old_lr:
            # Goyal et al., "Accurate, Large Minibatch SGD": scale momentum with the LR change.
            self.restore_momentum = float(np.asarray(momentum.numpy()))
            momentum.assign(self.restore_momentum * new_lr / old_lr)

    def _restore_momentum_if_needed(self) -> None:
        if self.restore_momentum is not None:
            self.model.optimizer.momentum.assign(self.restore_momentum)
            self.restore_momentum = None

    def on_train_begin(self, logs: Any = None) -> None:
        fix_jit(self.model)
        if not self.staircase:
            self._steps()

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current_epoch = epoch

    def on_batch_begin(self, batch: int, logs: Any = None) -> None:
        epoch = self.current_epoch if self.current_epoch is not None else 0
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(epoch)
        elif not self.staircase:
            self._adjust_learning_rate(epoch + float(batch) / self._steps())

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if logs is not None:
            logs["lr"] = get_lr(self.model.optimizer)


class LearningRateWarmupCallbackImpl(LearningRateScheduleCallbackImpl):
    """Ramp the LR linearly from ``initial_lr / size()`` to ``initial_lr`` over ``warmup_epochs``."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            # Shift by one step so the value at each epoch end is round (nicer LR plots).
            epoch += 1.0 / self._steps()
            size = _basics.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, 0, warmup_epochs, False, momentum_correction, steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0 and _basics.rank() == 0:
            new_lr = get_lr(self.model.optimizer)
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {new_lr:g}.")  # noqa: T201
