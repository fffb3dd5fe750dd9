"""Keras distributed optimizers for every Keras backend, without TensorFlow.

Works with Keras 3 on its TensorFlow, PyTorch and JAX backends (``KERAS_BACKEND``) and with Keras 2
(``tf_keras``, ``TF_USE_LEGACY_KERAS=1``), both the current and the ``legacy`` optimizers. The
distributed optimizer is an instance of a subclass of the user's optimizer class with the same class
name (saved models load without Horovod), made by ``from_config`` (hyper-parameters copied, no slot
state).

On torch and JAX the gradients are reduced by ``horovod._keras.backends``. On TensorFlow (and Keras 2)
the caller passes ``tensorflow_reduction`` (``horovod.tensorflow._keras_optimizer``), which builds the
TensorFlow graph reduction and local aggregation; this module imports no framework, so that
``horovod.keras`` runs on torch and JAX without TensorFlow.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from horovod._keras.backends import KERAS3_BACKENDS, make_reduce
from horovod.common.optimizer_args import check_op_args, normalize_groups
from horovod.common.process_sets import ProcessSet, global_process_set

__all__ = ["create_distributed_optimizer", "distributed_class", "is_distributed", "disable_jit_for",
           "backend_name", "keras_backend", "optimizer_backend", "HvdConfig", "TensorFlowReduction"]

log = logging.getLogger("horovod")

# ``tensorflow_reduction(cfg) -> (reduce(grads, variables) -> grads, aggregation helper or None,
# var_key)``: the TensorFlow backend's reduction built from ``cfg``'s settings.
TensorFlowReduction = Callable[["HvdConfig"], tuple[Callable[[list[Any], list[Any]], list[Any]], Any,
                                                    Callable[[Any], Any]]]


class HvdConfig:
    """Plain (untracked) holder of a distributed optimizer's Horovod settings.

    Raises:
        ValueError: the TensorFlow backend without ``tensorflow_reduction``.
    """

    def __init__(self, device_dense: str, device_sparse: str, compression: Any, sparse_as_dense: bool,
                 gradient_predivide_factor: float, op: int, backward_passes_per_step: int,
                 average_aggregated_gradients: bool, groups: Any, process_set: ProcessSet,
                 scale_local_gradients: bool, name: str, backend: str = "tensorflow", *,
                 tensorflow_reduction: TensorFlowReduction | None = None) -> None:
        self.device_dense, self.device_sparse = device_dense, device_sparse
        self.compression, self.sparse_as_dense = compression, sparse_as_dense
        self.gradient_predivide_factor, self.op = gradient_predivide_factor, op
        self.backward_passes_per_step = backward_passes_per_step
        self.average_aggregated_gradients = average_aggregated_gradients
        self.groups, self.name = groups, name
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self.local_vars: set[Any] = set()
        self.backend = backend
        self.agg: Any = None
        self.var_key: Callable[[Any], Any] = id
        if backend != "tensorflow":
            # Keras accumulates (gradient_accumulation_steps) and hands us the mean; upstream sums.
            post = 1.0 if average_aggregated_gradients else float(backward_passes_per_step)
            self.reduce_native = make_reduce(backend, op, compression, 1.0 / gradient_predivide_factor,
                                             gradient_predivide_factor * post, process_set, name + "_Allreduce")
            return
        if tensorflow_reduction is None:
            raise ValueError("The TensorFlow backend of Keras needs horovod.tensorflow's gradient reduction.")
        self.reduce, self.agg, self.var_key = tensorflow_reduction(self)


def _hvd(opt: Any) -> HvdConfig:
    cfg = opt.__dict__.get("_hvd_config")
    return cfg if cfg is not None else type(opt)._hvd_class_config


def disable_jit_for(model: Any) -> bool:
    """Turn XLA off for a Keras model whose optimizer is distributed; True if it was on."""
    try:
        on = bool(model.jit_compile)
    except AttributeError:
        return False
    if on:
        model.jit_compile = False
        log.info("Horovod: compiled the model with jit_compile=False (XLA cannot run Horovod's ops).")
    return on


def _disable_jit_on_calling_model(opt: Any) -> None:
    # Keras 3 builds the optimizer from Trainer._symbolic_build(), before make_train_function()
    # reads model.jit_compile. Find that model on the stack and turn XLA off while it still matters.
    frame: FrameType | None = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        if owner is not None and getattr(owner, "optimizer", None) is opt and hasattr(owner, "jit_compile"):
            disable_jit_for(owner)
            return
        frame = frame.f_back


def _keras3_native_methods(base: type[Any]) -> dict[str, Any]:
    # torch and JAX backends: reduce where Keras hands the step's gradients to the update (see
    # horovod._keras.backends); the train step stays compiled on JAX.
    def _clip_gradients(self: Any, grads: Any) -> Any:
        cfg = _hvd(self)
        if cfg.local_vars:
            raise NotImplementedError("PartialDistributedOptimizer (local layers) needs the TensorFlow "
                                      "backend of Keras.")
        return base._clip_gradients(self, cfg.reduce_native(list(grads)))

    return {"_clip_gradients": _clip_gradients}


def _keras3_methods(base: type[Any]) -> dict[str, Any]:
    def build(self: Any, variables: Any) -> Any:
        _disable_jit_on_calling_model(self)  # TensorFlow backend: XLA cannot run Horovod's ops
        return base.build(self, variables)

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        cfg = _hvd(self)
        grads = list(grads)
        variables = list(trainable_variables) if trainable_variables is not None else list(
            self._trainable_variables)
        if cfg.agg is None:
            return base.apply(self, cfg.reduce(grads, variables), trainable_variables)
        if not self.built:
            self.build(variables)
            self.built = True
        summed = cfg.agg.compute_gradients(grads, variables)
        return cfg.agg.apply_gradients(lambda: base.apply(self, summed, trainable_variables),
                                       self._iterations)

    return {"build": build, "apply": apply}


def _keras2_methods(base: type[Any]) -> dict[str, Any]:
    # Gradients are averaged where upstream does it: in _compute_gradients (what Keras 2's legacy
    # minimize() calls; scripts call it too), with the local aggregation of backward_passes_per_step
    # there. apply_gradients() averages gradients that did not come from _compute_gradients (the
    # new tf_keras optimizers' minimize() calls compute_gradients(); custom loops pass their own).
    def _compute_gradients(self: Any, loss: Any, var_list: Any, grad_loss: Any = None,
                           tape: Any = None) -> list[tuple[Any, Any]]:
        cfg = _hvd(self)
        if hasattr(base, "_compute_gradients"):  # legacy OptimizerV2
            pairs = base._compute_gradients(self, loss, var_list, grad_loss=grad_loss, tape=tape)
        else:
            if grad_loss is not None:
                raise ValueError(f"{base.__name__}.compute_gradients takes no grad_loss; pass "
                                 "output_gradients through your own tf.GradientTape instead.")
            pairs = base.compute_gradients(self, loss, var_list, tape=tape)
        pairs = list(pairs)
        if not pairs:
            return pairs
        grads, variables = [list(x) for x in zip(*pairs)]
        reduced = cfg.agg.compute_gradients(grads, variables) if cfg.agg else cfg.reduce(grads, variables)
        self.__dict__["_hvd_reduced"] = list(reduced)
        return list(zip(reduced, variables))

    def apply_gradients(self: Any, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        cfg = _hvd(self)
        pairs = list(grads_and_vars)
        if not pairs:
            return base.apply_gradients(self, pairs, *args, **kwargs)
        grads, variables = [list(x) for x in zip(*pairs)]
        done = self.__dict__.pop("_hvd_reduced", None)
        reduced = done is not None and len(done) == len(grads) and all(a is b for a, b in zip(done, grads))
        if cfg.agg is None:
            if not reduced:
                grads = cfg.reduce(grads, variables)
            return base.apply_gradients(self, list(zip(grads, variables)), *args, **kwargs)
        if not reduced:
            grads = cfg.agg.compute_gradients(grads, variables)
        return cfg.agg.apply_gradients(
            lambda: base.apply_gradients(self, list(zip(grads, variables)), *args, **kwargs),
            self.iterations)

    return {"_compute_gradients": _compute_gradients, "apply_gradients": apply_gradients}


def _register_local_var(self: Any, var: Any) -> None:
    """Keep ``var``'s gradient local (not averaged across ranks)."""
    cfg = _hvd(self)
    cfg.local_vars.add(cfg.var_key(var))


def is_distributed(optimizer: Any) -> bool:
    return getattr(type(optimizer), "_hvd_distributed", False)


def distributed_class(base: type[Any], cfg: HvdConfig) -> type[Any]:
    """A subclass of ``base`` with the same name whose gradient application averages across ranks."""
    if getattr(base, "_hvd_distributed", False):
        base = base.__mro__[1]
    keras3 = hasattr(base, "stateless_apply")
    if keras3 and cfg.backend != "tensorflow":
        methods = _keras3_native_methods(base)
    else:
        methods = _keras3_methods(base) if keras3 else _keras2_methods(base)
    methods.update(register_local_var=_register_local_var, _hvd_distributed=True,
                   _hvd_class_config=cfg, __module__=base.__module__,
                   _agg_helper=property(lambda self: _hvd(self).agg))
    return type(base.__name__, (base,), methods)


def backend_name(keras: Any) -> str:
    """``keras.backend.backend()`` of a Keras module or of its ``backend`` module; ``tensorflow`` where
    there is none (Keras 2: ``tf_keras``, ``tf.keras``)."""
    backend = getattr(keras, "backend", None)
    if not callable(backend):
        backend = getattr(backend, "backend", None)
    return str(backend()) if callable(backend) else "tensorflow"


def keras_backend(keras: Any) -> str:
    """The Keras backend in use: ``tensorflow`` (also for Keras 2), ``torch`` or ``jax``.

    Raises:
        ValueError: a backend Horovod does not support (``numpy``, ``openvino``).
    """
    name = backend_name(keras)
    if name not in KERAS3_BACKENDS:
        raise ValueError(f"horovod.keras supports the Keras backends {', '.join(KERAS3_BACKENDS)}, but "
                         f"KERAS_BACKEND is {name!r} (it cannot train).")
    return name


def create_distributed_optimizer(keras: Any, optimizer: Any, name: str | None, device_dense: str,
                                 device_sparse: str, compression: Any, sparse_as_dense: bool,
                                 gradient_predivide_factor: float, op: int, backward_passes_per_step: int = 1,
                                 average_aggregated_gradients: bool = False, groups: Any = None,
                                 process_set: ProcessSet = global_process_set,
                                 scale_local_gradients: bool = True, num_groups: int = 0, *,
                                 tensorflow_reduction: TensorFlowReduction | None = None) -> Any:
    """Return a distributed copy of a Keras optimizer (see module docstring).

    Raises:
        ValueError: ``op`` other than Average/Sum; predivide with Sum; bad ``groups``; a Keras
            backend that cannot train; the TensorFlow backend without ``tensorflow_reduction``.
    """
    backend = keras_backend(keras)
    op = check_op_args(op, gradient_predivide_factor, average_aggregated_gradients, keras=True)
    groups = normalize_groups(num_groups, groups)
    base = type(optimizer)
    if getattr(base, "_hvd_distributed", False):
        base = base.__mro__[1]
    dist_name = name or f"Distributed{base.__name__}"
    cfg = HvdConfig(device_dense, device_sparse, compression, sparse_as_dense, gradient_predivide_factor, op,
                    backward_passes_per_step, average_aggregated_gradients, groups, process_set,
                    scale_local_gradients, dist_name, backend, tensorflow_reduction=tensorflow_reduction)
    cls = distributed_class(base, cfg)
    config = optimizer.get_config()
    if backend != "tensorflow" and backward_passes_per_step > 1:
        config["gradient_accumulation_steps"] = int(backward_passes_per_step)
    if name is not None or "name" in config:
        config["name"] = dist_name
    new = cls.from_config(config)
    new.__dict__["_hvd_config"] = cfg
    return new


def optimizer_backend(opt: Any) -> str:
    """The Keras backend a distributed optimizer reduces for (``tensorflow`` for other optimizers)."""
    cfg = opt.__dict__.get("_hvd_config") or getattr(type(opt), "_hvd_class_config", None)
    return getattr(cfg, "backend", "tensorflow")
