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
from horovod.common.elastic.worker import is_elastic as _is_elastic
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from horovod.torch.elastic.sampler import ElasticSampler
from horovod.torch.elastic.state import TorchState

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HorovodInternalError",
           "HostsUpdatedInterrupt"]

if _is_elastic():
    # torch imports torch._dynamo when the first optimizer is made (seconds). An elastic worker
    # pays it here, before hvd.init() tells the driver it is ready, not while the workers it
    # joins wait for it in the new round's first collective.
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - only a warm-up
        pass


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
