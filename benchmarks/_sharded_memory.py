"""What the fully sharded memory benchmarks (``fully_shard_memory_phases.py``,
``fully_shard_memory_trace.py``) share in each rank: ``/proc/self/status`` fields, the kernel's
peak-RSS reset, and the model they measure.

Their rank functions run under ``horovod.testing.run_ranks``, which imports no ``benchmarks``
module in the ranks: a script calls ``by_value()`` before it launches, so that this module travels
with the pickled function.
"""

from __future__ import annotations

import sys
from typing import Any


def by_value() -> None:
    """Pickle this module by value (into the ranks) from now on."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def status(field: str) -> int:
    """``field`` of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))


def reset_peak() -> None:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def sharded_stack(layers: int, width: int) -> tuple[Any, Any]:
    """``layers`` x ``Linear(width, width)`` (seeded by index), each wrapped in ``hvd.fully_shard``,
    then the ``Sequential`` of them, and an ``AdamW`` over its parameters."""
    import torch

    import horovod.torch as hvd

    blocks = []
    for i in range(layers):
        torch.manual_seed(i)
        b = torch.nn.Linear(width, width)
        hvd.fully_shard(b)  # type: ignore[attr-defined]
        blocks.append(b)
    model = torch.nn.Sequential(*blocks)
    hvd.fully_shard(model)  # type: ignore[attr-defined]
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
