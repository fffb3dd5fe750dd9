"""Process sets: subsets of ranks that run collectives among themselves."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from horovod.common.current import get_context

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]


def _is_mpi_comm(obj: Any) -> bool:
    return hasattr(obj, "Get_group") and hasattr(obj, "Get_size")


class ProcessSet:
    """A set of global ranks (or an mpi4py communicator) that collectives can be restricted to.

    Register it with ``hvd.init(process_sets=[...])`` or ``hvd.add_process_set(...)`` before use;
    ``process_set_id`` is None until then. Ranks are stored sorted, so a permutation denotes the
    same set.
    """

    def __init__(self, ranks_or_comm: Iterable[int] | Any) -> None:
        self.process_set_id: int | None = None
        self.mpi_comm: Any = None
        self.ranks: list[int] | None
        if _is_mpi_comm(ranks_or_comm):
            self.mpi_comm = ranks_or_comm
            self.ranks = None
        else:
            ranks = list(ranks_or_comm)
            if not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
                raise ValueError(f"ProcessSet ranks must be integers, got {ranks!r}")
            self.ranks = sorted(ranks)

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> int | None:
        """Number of ranks in the set, or None if it is not registered."""
        if self.process_set_id is None or self.ranks is None:
            return None
        return len(self.ranks)

    def rank(self) -> int | None:
        """This process's index within the set (None if unregistered).

        Raises:
            ValueError: this process is not a member of the set.
        """
        if self.process_set_id is None or self.ranks is None:
            return None

        me = get_context().topology.rank
        if me not in self.ranks:
            raise ValueError("Process is not part of provided process set.")
        return self.ranks.index(me)

    def included(self) -> bool | None:
        """Whether this process is a member (None if the ranks are not known yet)."""
        if self.ranks is None:
            return None

        return get_context().topology.rank in self.ranks

    def __str__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __repr__ = __str__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessSet) and self.ranks == other.ranks and \
            self.process_set_id == other.process_set_id

    def __hash__(self) -> int:
        return hash((tuple(self.ranks or ()), self.process_set_id))


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def add_process_set(process_set: ProcessSet | Iterable[int]) -> ProcessSet:
    """Register a new process set after init; every rank must call this identically, in order.

    Requires ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` or ``hvd.init(process_sets="dynamic")``.

    Raises:
        ValueError: dynamic process sets are off, or the same ranks are already a registered set.
        NotImplementedError: the set is given as an MPI communicator.
    """

    return get_context().add_process_set(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank; returns False for the global or an unknown set."""

    return get_context().remove_process_set(process_set)
