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

import tensorflow as tf

from horovod._keras.state import KerasModelState, VariablesState
from horovod.common.basics import rank
from horovod.common.elastic import ObjectState, State, run_fn
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from horovod.common.objects import broadcast_object
from horovod.tensorflow import _errors

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


class TensorFlowKerasState(KerasModelState):
    """State of a Keras model (and its optimizer) trained with TensorFlow (``KerasModelState``).

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default ``model.optimizer``).
        backend: accepted for upstream compatibility (TF1 graph mode is not supported).
        kwargs: plain values kept as attributes (epoch, batch...).

    Raises:
        ValueError: the model is not built yet.
    """


class TensorFlowState(VariablesState):
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
