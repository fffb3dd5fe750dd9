"""Elastic training for TensorFlow 2 (and Keras models): ``hvd.elastic.run``,
``TensorFlowKerasState`` and ``TensorFlowState``.

The worker side (``State``, the retry loop, joining rounds) is framework neutral
(``horovod.common.elastic``); this module adds what TensorFlow needs: copies of variables as
NumPy arrays (``commit``), assignment back (``restore``), rank 0's values for everyone (``sync``),
and TF errors raised from Horovod ops turned into ``HorovodInternalError``.

``sync`` sends the values of every variable from rank 0 as one object and first gives an
optimizer without slots its variables (``optimizer.build``): a new worker joining a trained job
then receives the same set of variables instead of waiting in broadcasts the others never make
(upstream #2652).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from horovod.common.basics import rank
from horovod.common.elastic import ObjectState, State, run_fn
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from horovod.common.objects import broadcast_object
from horovod.tensorflow import _errors
from horovod.tensorflow.functions import assign_values

__all__ = ["run", "State", "ObjectState", "TensorFlowKerasState", "TensorFlowState",
           "HorovodInternalError", "HostsUpdatedInterrupt"]

def _reset() -> None:
    from horovod.common import basics

    basics.shutdown()
    basics.init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: run ``func(state, ...)`` in the elastic retry loop.

    A TensorFlow error of a Horovod op whose engine failed under it (a peer left: upstream's
    ``UnknownError`` of a shut-down engine) counts as ``HorovodInternalError`` and resets; every
    other error is raised, among them ranks disagreeing about a collective
    (``FailedPreconditionError``), which a reset would only repeat.
    """

    @functools.wraps(func)
    def wrapped(state: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as exc:
            if _errors.is_peer_loss(exc):
                raise HorovodInternalError(str(exc)) from exc
            raise

    return run_fn(wrapped, _reset)


def _variables(obj: Any) -> list[Any]:
    if obj is None:
        return []
    v = obj.variables
    return list(v() if callable(v) else v)


def _build_optimizer(optimizer: Any, model: Any) -> None:
    """Create an optimizer's slot variables now, as its first step would."""
    if optimizer is None or model is None:
        return
    params = list(model.trainable_variables)
    if hasattr(optimizer, "build") and not getattr(optimizer, "built", False) and \
            not getattr(optimizer, "_built", False):
        optimizer.build(params)
    elif hasattr(optimizer, "_create_all_weights"):  # tf_keras legacy optimizers
        optimizer._create_all_weights(params)


def _values(variables: Sequence[Any]) -> list[np.ndarray]:
    return [np.array(v.numpy(), copy=True) for v in variables]


def _assign(variables: Sequence[Any], values: Sequence[np.ndarray], what: str) -> None:
    assign_values(variables, values, f"elastic state: rank {rank()} has {{have}} {what} variables but the "
                  "state holds {want}; every worker must build the same model and optimizer.")


class _VariablesState(ObjectState):
    """Common part: a model-like and an optimizer-like holder of variables."""

    def _groups(self) -> dict[str, list[Any]]:
        raise NotImplementedError()

    def _prepare(self) -> None:
        """Make sure every variable exists before values move (see ``_build_optimizer``)."""

    def _save_vars(self) -> None:
        self._prepare()
        self._saved_vars = {k: _values(vs) for k, vs in self._groups().items()}

    def save(self) -> None:
        self._save_vars()
        super().save()

    def restore(self) -> None:
        groups = self._groups()
        for key, values in self._saved_vars.items():
            if len(groups.get(key, [])) == len(values):
                _assign(groups[key], values, key)
        super().restore()

    def sync(self) -> None:
        self._prepare()
        groups = self._groups()
        mine = {k: _values(vs) for k, vs in groups.items()} if rank() == 0 else None
        values = broadcast_object(mine, root_rank=0, name="elastic.tf_variables")
        if rank() != 0:
            for key, vals in values.items():
                _assign(groups.get(key, []), vals, key)
        self._save_vars()
        super().sync()


class TensorFlowKerasState(_VariablesState):
    """State of a Keras model (and its optimizer) trained with TensorFlow.

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default ``model.optimizer``).
        backend: accepted for upstream compatibility (TF1 graph mode is not supported).
        kwargs: plain values kept as attributes (epoch, batch...).

    Raises:
        ValueError: the model is not built yet.
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        if not getattr(model, "built", True):
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.backend = backend
        self._save_vars()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def _groups(self) -> dict[str, list[Any]]:
        return {"model": list(self.model.variables), "optimizer": _variables(self.optimizer)}

    def _prepare(self) -> None:
        _build_optimizer(self.optimizer, self.model)


class TensorFlowState(_VariablesState):
    """State of a list of ``tf.Variable`` (TensorFlow 2, eager).

    Args:
        variables: the variables to keep.
        session: accepted for upstream compatibility; TF1 sessions are not supported.
        kwargs: plain values kept as attributes.
    """

    def __init__(self, variables: Sequence[Any] | None = None, session: Any = None,
                 **kwargs: Any) -> None:
        if variables is None:
            raise ValueError("TensorFlowState needs the list of variables to keep (TF1 global "
                             "variables are not supported here).")
        if session is not None:
            raise ValueError("TensorFlowState: TF1 sessions are not supported; use TF2 eager "
                             "variables.")
        self.variables = list(variables)
        self._save_vars()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def _groups(self) -> dict[str, list[Any]]:
        return {"variables": self.variables}
