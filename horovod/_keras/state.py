"""Elastic state of Keras variables on any backend: copies as NumPy arrays (``commit``), assignment
back (``restore``), rank 0's values for everyone (``sync``). No framework imported: the variables
are used through ``numpy()`` and ``assign()``, as every Keras backend and TensorFlow provide them.

``sync`` sends the values of every variable from rank 0 as one object and first gives an
optimizer without slots its variables (``optimizer.build``): a new worker joining a trained job
then receives the same set of variables instead of waiting in broadcasts the others never make
(upstream #2652).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from horovod.common.basics import rank
from horovod.common.elastic import ObjectState
from horovod.common.objects import broadcast_object

__all__ = ["assign_values", "variables_of", "VariablesState", "KerasModelState"]


def assign_values(variables: Sequence[Any], values: Sequence[Any], mismatch: str) -> None:
    """``variable.assign(value)`` for each pair; a ``ValueError`` with ``mismatch`` (formatted with
    ``{have}`` variables and ``{want}`` values) when the counts differ."""
    if len(variables) != len(values):
        raise ValueError(mismatch.format(have=len(variables), want=len(values)))
    for variable, value in zip(variables, values):
        variable.assign(value)


def variables_of(obj: Any) -> list[Any]:
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


class VariablesState(ObjectState):
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


class KerasModelState(VariablesState):
    """State of a Keras model (and its optimizer), on any Keras backend.

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default ``model.optimizer``).
        backend: accepted for upstream compatibility (kept as ``self.backend``).
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
        return {"model": list(self.model.variables), "optimizer": variables_of(self.optimizer)}

    def _prepare(self) -> None:
        _build_optimizer(self.optimizer, self.model)
