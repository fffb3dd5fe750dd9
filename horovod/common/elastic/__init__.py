"""Elastic training, framework-neutral worker side: ``State``, ``ObjectState`` and the ``run`` loop.

Frameworks add their ``State`` subclass (``horovod.torch.elastic.TorchState``, ...); the driver
that starts, watches and regroups the workers is ``horovod.runner.elastic``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from horovod.common.elastic.run import default_reset, run_fn
from horovod.common.elastic.state import ObjectState, State
from horovod.common.elastic.worker import (
    HostUpdateResult,
    JobStoppedError,
    WorkerRemovedError,
    notification_manager,
)

__all__ = ["State", "ObjectState", "run_fn", "default_reset", "HostUpdateResult",
           "WorkerRemovedError", "JobStoppedError", "notification_manager", "run"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: run ``func(state, ...)`` in the elastic retry loop (framework neutral)."""
    return run_fn(func, default_reset)
