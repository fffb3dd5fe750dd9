"""The transport seam: what the executor's operations call to move and reduce buffers of one set.

The executor runs every operation (``executor.Executor``: allreduce, broadcast, allgather, alltoall,
reducescatter, join zeros) once, generic over two small objects, a ``Lane``'s:

* a ``BufferOps`` (``buffers``): what a buffer is (NumPy arrays, torch tensors where they live);
* a ``Transport`` bound to one process set: the collective calls on those buffers, the dtypes it
  reduces natively, and the one place where its library's errors become Horovod's.

``HostTransport`` is the job's CPU transport (MPI, Gloo, local) on NumPy buffers, flat or
hierarchical; a device plane (``device``) supplies a lane of its own (the torch one:
``horovod/torch/_device_plane.py``). The widening rule (``reduce_dtype``) and the scaling rule
(``buffers``) are the executor's and hold for every lane.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from horovod.common.backends.base import CollectiveBackend, Group
from horovod.common.engine.buffers import BufferOps, Placement
from horovod.common.engine.hierarchy import Hierarchy
from horovod.common.engine.tunables import Tunables
from horovod.common.types import ReduceOp

__all__ = ["Transport", "HostTransport", "Lane"]


class Transport(Protocol):
    """Collectives of one process set on one kind of buffer (see the module docstring).

    Buffers are flat. Counts are in elements of the buffers handed over (the ``BufferOps.move``
    views for data movement). Every method is collective over the set.
    """

    #: the timeline's activity prefix, as upstream's (``MPI``, ``GLOO``, ``NCCL``)
    name: str
    #: the dtype names this transport reduces natively (others are widened: ``dtypes.reduce_dtype``)
    native: frozenset[str]

    def reducer(self, op: ReduceOp) -> Callable[[Any], None]:
        """In-place reduction of a flat buffer over the set with ``op``."""

    def broadcast(self, buf: Any, root: int) -> None:
        """Copy member ``root``'s ``buf`` into every member's."""

    def allgatherv(self, send: Any, recv: Any, counts: list[int]) -> None:
        """Concatenate each member's ``send`` (``counts[i]`` elements from member i) into ``recv``."""

    def alltoallv(self, send: Any, send_counts: list[int], recv: Any, recv_counts: list[int]) -> None:
        """Send ``send_counts[i]`` consecutive elements to member i; receive likewise."""

    def reducescatter(self, send: Any, recv: Any, counts: list[int], op: ReduceOp, scratch: bool) -> None:
        """Reduce ``send`` and give member i its ``counts[i]`` elements in ``recv``; ``scratch``:
        ``send`` is the executor's own copy and may be overwritten."""

    def allgather_ints(self, values: np.ndarray) -> np.ndarray:
        """A 1-D int64 array from each member: shape (set size, len(values))."""

    def alltoall_ints(self, values: np.ndarray) -> np.ndarray:
        """Member i sends ``values[j]`` to member j; what each member sent here (int64)."""


@dataclass(frozen=True)
class Lane:
    """What one batch runs on: buffers, their transport, where reductions happen, and the schedule.

    Attributes:
        ops: the buffer operations.
        transport: the set's transport.
        placement: in place or through a fusion buffer, per call (``placement``).
        chunk_bytes: the reduction's piece size (0: unchunked, tensors above ``max_tensor_bytes``
            alone and the others in one fused call).
        steps: whether the timeline shows the copy and transport steps of a reduction (host) or
            one activity per operation (a device plane, whose work the caller's thread only enqueues).
    """

    ops: BufferOps
    transport: Transport
    placement: Placement
    chunk_bytes: int
    steps: bool


class HostTransport:
    """``Transport`` over the job's CPU backend on NumPy buffers, for one group; hierarchical
    (intra-host, then across hosts) when the tunables ask for it and the set spans hosts evenly."""

    __slots__ = ("backend", "group", "name", "native", "_tunables", "_hierarchy")

    def __init__(self, backend: CollectiveBackend, group: Group, tunables: Tunables,
                 hierarchy: Callable[[Group], Hierarchy | None]) -> None:
        self.backend = backend
        self.group = group
        self.name = backend.name.upper()
        self.native = backend.reduce_dtypes()
        self._tunables = tunables
        self._hierarchy = hierarchy

    def reducer(self, op: ReduceOp) -> Callable[[np.ndarray], None]:
        if self._tunables.hierarchical_allreduce:
            hier = self._hierarchy(self.group)
            if hier is not None:
                return lambda buf: hier.allreduce(buf, op)
        backend, group = self.backend, self.group
        return lambda buf: backend.allreduce(buf, op, group)

    def starter(self, op: ReduceOp) -> tuple[Callable[[np.ndarray], Callable[[], None]], int] | None:
        """(start, depth) when the backend can keep ``depth`` >= 2 reductions in flight
        (``allreduce_start``: Gloo's asynchronous work), for ``buffers.run_pipelined``; None when
        reductions run one at a time (MPI's blocking calls, the hierarchy, ``HOROVOD_GLOO_PIPELINE``
        below 2)."""
        backend, group = self.backend, self.group
        start = getattr(backend, "allreduce_start", None)
        depth = int(getattr(backend, "pipeline", 0))
        if start is None or depth < 2 or group.size == 1:
            return None
        if self._tunables.hierarchical_allreduce and self._hierarchy(group) is not None:
            return None
        return (lambda buf: start(buf, op, group)), depth

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        self.backend.broadcast(buf, root, self.group)

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
        hier = self._hierarchy(self.group) if self._tunables.hierarchical_allgather else None
        if hier is not None:
            hier.allgatherv(send, recv, counts)
        else:
            self.backend.allgatherv(send, recv, counts, self.group)

    def alltoallv(self, send: np.ndarray, send_counts: list[int], recv: np.ndarray,
                  recv_counts: list[int]) -> None:
        self.backend.alltoallv(send, send_counts, recv, recv_counts, self.group)

    def reducescatter(self, send: np.ndarray, recv: np.ndarray, counts: list[int], op: ReduceOp,
                      scratch: bool) -> None:
        self.backend.reducescatter(send, recv, counts, op, self.group)

    def allgather_ints(self, values: np.ndarray) -> np.ndarray:
        return self.backend.allgather_ints(values, self.group)

    def exchange(self, send: np.ndarray, recv: np.ndarray, peer: int) -> None:
        """Send ``send`` to member ``peer`` and receive ``recv`` from it (Adasum's one primitive)."""
        self.backend.sendrecv(send, recv, peer, self.group)

    def alltoall_ints(self, values: np.ndarray) -> np.ndarray:
        return self.backend.alltoall_ints(values, self.group)

