"""Elastic training for PyTorch: ``hvd.elastic.run``, ``TorchState``, ``ElasticSampler``.

::

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...
        state.commit()

    train(state)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from horovod.common.elastic import ObjectState, State, run_fn
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from horovod.torch.elastic.sampler import ElasticSampler
from horovod.torch.elastic.state import TorchState

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HorovodInternalError",
           "HostsUpdatedInterrupt"]


def _reset() -> None:
    from horovod.common import basics

    basics.shutdown()
    basics.init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: run ``func(state, ...)`` in the elastic retry loop (``horovod.common.elastic``).

    On a failed collective the state goes back to its last commit, Horovod re-forms the job on the
    workers that remain, rank 0's state is broadcast and ``func`` runs again; on a host change it
    keeps its current state. No collective may run before ``func`` (``state.sync()`` runs first).
    """
    return run_fn(func, _reset)
