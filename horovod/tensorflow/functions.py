"""Broadcast helpers for TensorFlow: variables, global variables (TF1), hooks, Python objects."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from horovod._keras.state import assign_values
from horovod.common import objects as _objects
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.tensorflow.mpi_ops import _is_variable, broadcast_

__all__ = ["assign_values", "broadcast_variables", "broadcast_global_variables", "BroadcastGlobalVariablesHook",
           "broadcast_object", "broadcast_object_fn", "allgather_object"]


def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set, inplace: bool = False) -> Any:
    """Assign to every variable its value on ``root_rank``; all ranks of the set must call it.

    All variables go to the engine as one request (per dtype). In eager mode the assignment happens
    now and ``None`` is returned; in a graph (``tf.function``, TF1) the grouped assign op is returned.
    ``inplace`` is accepted for compatibility (assignment is always done in place).

    Raises:
        TypeError: an element is not a variable (``hvd.broadcast`` broadcasts tensor values).
    """
    del inplace
    variables = list(variables)
    for v in variables:
        if not _is_variable(v):
            raise TypeError(f"broadcast_variables expects variables (tf.Variable or Keras variables), got "
                            f"{type(v).__name__}. Use hvd.broadcast(tensor, root_rank) to broadcast a "
                            "tensor value.")
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    if tf.executing_eagerly():
        broadcast_(variables, root_rank, process_set=process_set)
        return None
    assigns = broadcast_(variables, root_rank, process_set=process_set)
    return tf.group(*[a.op if hasattr(a, "op") else a for a in assigns])


def broadcast_global_variables(root_rank: int) -> Any:
    """Return an op that broadcasts every global variable from ``root_rank`` (TF1 graphs only).

    Raises:
        RuntimeError: called in eager mode.
    """
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. Please use "
                           "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """SessionRunHook that broadcasts all global variables from ``root_rank`` after the session starts.

    Use it with ``tf.compat.v1.train.MonitoredTrainingSession`` so every rank starts from the same
    weights (random initialization or a checkpoint restored on rank 0).
    """

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op: Any = None
        self.device = device

    def begin(self) -> None:
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self.bcast_op)


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` (any picklable object) on every rank of the set.

    Works the same in eager and graph mode (``session`` is accepted for compatibility; the object
    travels through the engine directly).
    """
    del session
    return _objects.broadcast_object(obj, root_rank, name=name, process_set=process_set)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """Return ``fn(obj) -> root's obj``, for repeated broadcasts (TF1 helper; builds no ops)."""
    del session

    def _fn(obj: Any) -> Any:
        return _objects.broadcast_object(obj, root_rank, name=name, process_set=process_set)

    return _fn


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Return every rank's ``obj`` as a list in set-rank order (``process_set.size()`` items)."""
    del session
    return _objects.allgather_object(obj, name=name, process_set=process_set)
