"""Elastic training with JAX: ``hvd.elastic.run`` and ``JaxState``.

::

    state = hvd.elastic.JaxState(params=params, opt_state=opt_state, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.params, state.opt_state = step(state.params, state.opt_state, batch)
            state.commit()

    train(state)
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from horovod.common.basics import rank
from horovod.common.elastic import ObjectState, State, default_reset, run_fn
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from horovod.common.objects import broadcast_object
from horovod.jax.functions import broadcast_parameters
from horovod.jax.mpi_ops import last_error, set_last_error

__all__ = ["JaxState", "run", "State", "ObjectState", "HorovodInternalError", "HostsUpdatedInterrupt"]


def _has_arrays(value: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(value)
    return bool(leaves) and all(isinstance(x, jax.Array | np.ndarray) for x in leaves)


class JaxState(ObjectState):
    """Elastic state of pytrees of arrays (parameters, optimizer state) and plain Python values.

    Keyword arguments become attributes. A value whose leaves are all arrays (a pytree: params,
    an optax state) is kept by reference at ``commit()`` (JAX arrays are immutable, so a commit
    costs nothing) and broadcast from rank 0 by ``sync()`` as arrays (one grouped op per dtype);
    other values are deep-copied and broadcast as one object.
    """

    def __init__(self, **kwargs: Any) -> None:
        self._tree_attrs = {k for k, v in kwargs.items() if _has_arrays(v)}
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def save(self) -> None:
        self._saved_state = {k: getattr(self, k) if k in self._tree_attrs else copy.deepcopy(getattr(self, k))
                             for k in self._saved_state}

    def restore(self) -> None:
        for k, v in self._saved_state.items():
            setattr(self, k, v if k in self._tree_attrs else copy.deepcopy(v))

    def sync(self) -> None:
        trees = {k: v for k, v in self._saved_state.items() if k in self._tree_attrs}
        objects = {k: v for k, v in self._saved_state.items() if k not in self._tree_attrs}
        for k in sorted(trees):
            trees[k] = broadcast_parameters(trees[k], 0, name=f"JaxState.{k}")
        if objects:
            objects = self._bcast_object(objects)
        self._saved_state = {**objects, **trees}
        self.restore()


def _unwrap_jax_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a ``JaxRuntimeError`` raised by a jitted step whose collective failed back into
    Horovod's exception, so that the elastic loop sees a lost peer as ``HorovodInternalError``."""

    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Any:
        set_last_error(None)
        try:
            return func(*args, **kwargs)
        except jax.errors.JaxRuntimeError as exc:
            cause = last_error()
            set_last_error(None)
            if isinstance(cause, HorovodInternalError | HostsUpdatedInterrupt):
                raise cause from exc
            raise

    return call


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: run ``func(state, ...)`` in the elastic retry loop (see ``horovod.torch.elastic.run``).

    A collective that fails inside a jitted step (a lost peer) resets the job as an eager one does.
    """
    return run_fn(_unwrap_jax_errors(func), default_reset)
