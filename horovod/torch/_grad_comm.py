"""The communicator a ``StatefulCompressor`` receives: fused in-place averages and an object
allgather over the optimizer's process set, counting the bytes it submits."""

from __future__ import annotations

from typing import Any

import torch

from horovod.common import basics
from horovod.common.objects import allgather_object
from horovod.common.process_sets import ProcessSet
from horovod.common.types import Average, Max
from horovod.torch.mpi_ops import allreduce_, grouped_allreduce_async_, synchronize

__all__ = ["GradientCommunicator"]


class GradientCommunicator:
    """Collectives for a whole-step compressor over ``process_set`` (see ``StatefulCompressor``)."""

    def __init__(self, process_set: ProcessSet) -> None:
        self.process_set = process_set
        self.bytes_submitted = 0

    @property
    def rank(self) -> int:
        r = self.process_set.rank()
        return basics.rank() if r is None else r

    @property
    def size(self) -> int:
        n = self.process_set.size()
        return basics.size() if n is None else n

    def allreduce_async_(self, tensors: list[torch.Tensor], name: str) -> Any:
        """Start one fused, in-place average of ``tensors`` (named ``name`` on every rank)."""
        if not tensors:
            return None
        self.bytes_submitted += sum(t.numel() * t.element_size() for t in tensors)
        return grouped_allreduce_async_(tensors, name=name, op=Average, process_set=self.process_set)

    def wait(self, handle: Any) -> None:
        """Wait for ``allreduce_async_``'s handle (the tensors then hold the averages)."""
        if handle is not None:
            synchronize(handle)

    def allreduce_(self, tensors: list[torch.Tensor], name: str) -> None:
        self.wait(self.allreduce_async_(tensors, name))

    def agree(self, values: list[int], name: str) -> bool:
        """Whether every rank passed the same integers (one Max allreduce of ``values`` and their
        negations): the same answer on every rank."""
        v = torch.tensor(list(values), dtype=torch.int64)
        both = torch.cat([v, -v])
        out = allreduce_(both, name=name, op=Max, process_set=self.process_set)
        n = len(values)
        return bool(torch.equal(out[:n], -out[n:]))

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        return allgather_object(obj, name=name, process_set=self.process_set)
