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
from horovod.common.elastic.worker import warm_up_before_joining as _warm_up_before_joining
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from horovod.torch.elastic._replica_plan import LostRowsError
from horovod.torch.elastic.sampler import ElasticSampler
from horovod.torch.elastic.state import TorchState

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HorovodInternalError",
           "HostsUpdatedInterrupt", "LostRowsError"]

def _load_dynamo() -> None:
    import torch._dynamo  # noqa: F401


# torch imports torch._dynamo when the first optimizer is made (seconds). An elastic worker pays it in
# hvd.init(), before it tells the driver it is ready, not while the workers it joins wait for it in
# the new round's first collective. Importing this module only registers it (outside elastic jobs it
# never runs).
_warm_up_before_joining("torch._dynamo", _load_dynamo)


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
