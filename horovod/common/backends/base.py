"""The two roles a transport plays for the engine, each a small protocol.

``Controller`` moves negotiation messages (a bit-vector AND for the cached fast path, and encoded
request lists gathered to rank 0 / response lists broadcast from it). Its messages are plain
values sent in ``horovod.common.plain``, never pickle: whoever reaches a transport's connections
must not be able to run code in the ranks. ``CollectiveBackend`` runs
collectives on flat, C-contiguous NumPy buffers (or, for device backends, framework tensors).
One transport module (``mpi.py``, ``gloo.py``, ``local.py``) usually implements both in one class.

Only the engine's background thread calls these methods, so implementations need no locking.
Every method is collective over the ranks of ``group`` (or the whole world for the controller),
and every rank calls them in the same order.

Transport failures must be raised as ``HorovodInternalError`` (``raise ... from exc``), from one
place in each backend.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from horovod.common.types import ReduceOp

__all__ = ["CollectiveBackend", "Controller", "Group", "LOCAL_REDUCE", "PartsBuffer", "SplitsGroups", "EngineBackend"]


# NumPy's reduction for each operation, for a backend that reduces the parts it received itself
# (in member order, so that every member computing a part gets the same bits).
LOCAL_REDUCE = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
                ReduceOp.PRODUCT: np.multiply}


class PartsBuffer:
    """A reduce-scatter's receive buffer: every member's part of this member's rows, ``(p, mine)``.
    Up to ``KEEP`` bytes it is kept for the next call (a sharded model's per-block reduce-scatters
    reuse it rather than churning the allocator)."""

    KEEP = 64 << 20

    def __init__(self) -> None:
        self._buf: np.ndarray | None = None

    def parts(self, p: int, mine: int, dtype: np.dtype) -> np.ndarray:
        need = p * mine * dtype.itemsize
        buf = self._buf
        if buf is None or buf.nbytes < need:
            buf = np.empty(need, np.uint8)
            if need <= self.KEEP:
                self._buf = buf
        return buf[:need].view(dtype).reshape(p, mine)


class Group:
    """A process set as a backend sees it: sorted global ranks and a backend communicator."""

    __slots__ = ("ranks", "rank", "size", "handle")

    def __init__(self, ranks: list[int], my_global_rank: int, handle: Any) -> None:
        self.ranks = list(ranks)
        self.size = len(self.ranks)
        # This process's index inside the group, or -1 when it is not a member.
        self.rank = self.ranks.index(my_global_rank) if my_global_rank in self.ranks else -1
        self.handle = handle


@runtime_checkable
class Controller(Protocol):
    """Negotiation transport over the whole world of the job."""

    rank: int
    size: int

    def and_bits(self, bits: np.ndarray, spin: bool = True) -> np.ndarray:
        """Return the bitwise AND over all ranks of a 1-D uint64 array (same length everywhere).

        ``spin`` says whether waiting for slower ranks may busy-poll briefly (a caller blocks on
        the result) or should sleep between polls (background rounds during a backward pass,
        where a spinning engine takes CPU from the computation).
        """

    def gather_to_root(self, obj: Any) -> list[Any] | None:
        """Gather one plain value (``horovod.common.plain``) per rank to rank 0; rank 0 gets the
        list, others None."""

    def bcast_from_root(self, obj: Any) -> Any:
        """Broadcast a plain value from rank 0; every rank returns it."""

    def allgather_object(self, obj: Any) -> list[Any]:
        """Return every rank's plain value, in rank order (used at init for host names)."""


@runtime_checkable
class CollectiveBackend(Protocol):
    """Data transport: collectives on flat buffers of one process set."""

    name: str

    def world_group(self) -> Group:
        """The group of all ranks."""

    def new_group(self, ranks: list[int]) -> Group:
        """Make a group of these global ranks. Collective over *all* ranks of the world."""

    def free_group(self, group: Group) -> None:
        """Release a group made by ``new_group``."""

    def reduce_dtypes(self) -> frozenset[str]:
        """The dtypes this backend can reduce natively; others are widened by the engine."""

    def allreduce(self, buf: np.ndarray, op: ReduceOp, group: Group, src: np.ndarray | None = None) -> None:
        """Reduce across the group into ``buf`` (``op`` is SUM, MIN, MAX or PRODUCT).

        With ``src`` the local contribution is read from ``src`` (same size and dtype, never
        overlapping ``buf``) and ``buf`` only receives the result; without it, ``buf`` is reduced in
        place. A backend without an out-of-place primitive copies ``src`` into ``buf`` first.
        """

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int], group: Group) -> None:
        """Concatenate each member's ``send`` (``counts[i]`` elements from member i) into ``recv``."""

    def broadcast(self, buf: np.ndarray, root: int, group: Group) -> None:
        """Copy the buffer of group member ``root`` (an index in the group) into every member's."""

    def alltoallv(self, send: np.ndarray, send_counts: list[int], recv: np.ndarray,
                  recv_counts: list[int], group: Group) -> None:
        """Send ``send_counts[i]`` consecutive elements to member i; receive likewise."""

    def reducescatter(self, send: np.ndarray, recv: np.ndarray, counts: list[int], op: ReduceOp,
                      group: Group) -> None:
        """Reduce ``send`` across members and give member i its ``counts[i]`` elements in ``recv``."""

    def allgather_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        """Gather a 1-D int64 array from each member; returns shape (group.size, len(values))."""

    def alltoall_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        """Member i sends ``values[j]`` to member j; returns what each member sent here (int64)."""

    def barrier(self, group: Group) -> None:
        """Block until every member arrives."""

    def sendrecv(self, send: np.ndarray, recv: np.ndarray, peer: int, group: Group) -> None:
        """Send ``send`` to member ``peer`` (an index in the group) and receive ``recv`` from it.

        Point to point between two members only (Adasum's pairwise exchanges); ``peer`` calls it
        with this member's index at the same point. Any dtype (the bytes travel).
        """

    def close(self) -> None:
        """Release the transport's resources at shutdown (must not prevent a later init)."""


@runtime_checkable
class EngineBackend(Controller, CollectiveBackend, Protocol):
    """What the engine is given: one object in both roles (every backend module's ``create``)."""


@runtime_checkable
class SplitsGroups(CollectiveBackend, Protocol):
    """A backend that can split a group by colour (what hierarchical collectives need)."""

    def split_group(self, parent: Group, colors: list[int]) -> Group:
        """Split ``parent`` into the groups of members with the same colour (collective over it);
        members with a negative colour get a group they are not in."""
