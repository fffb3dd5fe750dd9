"""A job of one process: every collective is a local copy. Used for ``python train.py``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from horovod.common.backends.base import Group
from horovod.common.config import EngineConfig
from horovod.common.types import ReduceOp

__all__ = ["LocalBackend", "create"]


class LocalBackend:
    """Controller and collective backend of a single-process world."""

    name = "local"
    rank = 0
    size = 1

    def and_bits(self, bits: np.ndarray, spin: bool = True) -> np.ndarray:
        return bits.copy()

    def gather_to_root(self, obj: Any) -> list[Any]:
        return [obj]

    def bcast_from_root(self, obj: Any) -> Any:
        return obj

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def world_group(self) -> Group:
        return Group([0], 0, None)

    def new_group(self, ranks: list[int]) -> Group:
        return Group(sorted(ranks), 0, None)

    def free_group(self, group: Group) -> None:
        pass

    def reduce_dtypes(self) -> frozenset[str]:
        return frozenset({"uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
                          "float16", "float32", "float64"})

    def allreduce(self, buf: np.ndarray, op: ReduceOp, group: Group, src: np.ndarray | None = None) -> None:
        if src is not None:
            np.copyto(buf, src)

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int], group: Group) -> None:
        np.copyto(recv, send)

    def broadcast(self, buf: np.ndarray, root: int, group: Group) -> None:
        pass

    def alltoallv(self, send: np.ndarray, send_counts: list[int], recv: np.ndarray,
                  recv_counts: list[int], group: Group) -> None:
        np.copyto(recv, send[: recv.size])

    def reducescatter(self, send: np.ndarray, recv: np.ndarray, counts: list[int], op: ReduceOp,
                      group: Group) -> None:
        np.copyto(recv, send[: recv.size])

    def allgather_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        return np.asarray(values, np.int64).reshape(1, -1)

    def alltoall_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        return np.asarray(values, np.int64).copy()

    def barrier(self, group: Group) -> None:
        pass

    def sendrecv(self, send: np.ndarray, recv: np.ndarray, peer: int, group: Group) -> None:
        np.copyto(recv, send)  # the only member is its own peer

    def close(self) -> None:
        pass


def create(config: EngineConfig, environ: Mapping[str, str], comm: Any = None) -> LocalBackend:
    return LocalBackend()
