"""Value types shared by the engine, the backends and the adapters: ops, requests, responses."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "ArgumentError", "ReduceOp", "RequestType", "Request", "Response", "REDUCE_OP_NAMES",
    "dtype_name", "shape_text",
]


class ReduceOp(enum.IntEnum):
    """Reduction operations, with upstream Horovod's integer values."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5

    # Enum's default __hash__ is Python-level and shows up in profiles of the engine's hot path.
    __hash__ = int.__hash__


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

REDUCE_OP_NAMES = {op: op.name.capitalize() for op in ReduceOp}


class RequestType(enum.Enum):
    """What a request asks the engine to do; the value is the name prefix of the operation."""

    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"
    BROADCAST = "broadcast"
    ALLTOALL = "alltoall"
    REDUCESCATTER = "reducescatter"
    BARRIER = "barrier"
    JOIN = "join"
    ADD_PROCESS_SET = "add_process_set"
    REMOVE_PROCESS_SET = "remove_process_set"

    # Members are singletons and compare by identity: the identity hash is correct and fast.
    __hash__ = object.__hash__

    @property
    def upper(self) -> str:
        return self.value.upper()


# Kinds whose first dimension may differ across ranks.
RAGGED_KINDS = frozenset({RequestType.ALLGATHER, RequestType.ALLTOALL})


def dtype_name(dtype: Any) -> str:
    """Name a dtype the way errors show it (``float32``, ``bfloat16``)."""
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


@dataclass(frozen=True)
class ArgumentError:
    """The payload of a request whose call failed its argument checks on the submitting rank.

    The rank still submits the operation's name, so that the coordinator can fail the name on
    every rank of the set instead of leaving the others waiting for a rank that raised locally.
    """

    error_type: str
    message: str

    def __str__(self) -> str:
        return f"{self.error_type}: {self.message}"


@dataclass(slots=True, eq=False)
class Request:
    """One named operation as a rank submits it: a single tensor, or a group of tensors.

    Every rank of ``process_set_id`` must submit a request with the same ``name``; the coordinator
    checks that the other fields agree (see ``negotiation.py``). A grouped operation is one request
    with several shapes: it is negotiated, fused and completed as a unit.
    """

    name: str
    kind: RequestType
    dtype: str = "float32"
    shapes: tuple[tuple[int, ...], ...] = ()
    reduce_op: ReduceOp = ReduceOp.SUM
    prescale: float = 1.0
    postscale: float = 1.0
    root_rank: int = -1
    process_set_id: int = 0
    device: str = "cpu"
    payload: Any = None
    rank: int = -1
    # A layout hint, not an argument (so not in the signature, and ranks may differ): this rank's
    # tensors of an in-place grouped allreduce lie end to end in one buffer (views of a flattened
    # gradient set). The coordinator keeps it only when every rank's tensors do, and then every
    # rank reduces the group as one span (``executor``), whatever its own memory looks like.
    flat: bool = False
    _sig: Any = None
    _digest: int = 0  # wire.digest(self), computed once

    def signature(self) -> tuple[Any, ...]:
        """What must stay the same for a cached negotiation of this name to be reused."""
        if self._sig is not None:
            return self._sig
        if self.kind in RAGGED_KINDS:
            shapes: tuple[Any, ...] = tuple(s[1:] for s in self.shapes)
        else:
            shapes = self.shapes
        self._sig = (self.kind, self.dtype, shapes, self.reduce_op, self.prescale, self.postscale,
                     self.root_rank, self.process_set_id, self.device, self.payload)
        return self._sig

    @property
    def nbytes(self) -> int:
        item = 2 if self.dtype == "bfloat16" else np.dtype(self.dtype).itemsize
        total = 0
        for s in self.shapes:
            n = 1
            for d in s:
                n *= d
            total += n
        return total * item


@dataclass(slots=True, eq=False)
class Response:
    """The coordinator's decision for one name: execute it (``error is None``) or fail it everywhere.

    ``request`` holds the agreed parameters (taken from the lowest rank that submitted). Every rank
    of the process set executes the same responses in the same order.
    """

    request: Request
    error: str | None = None
    error_fields: dict[str, Any] = field(default_factory=dict)
    joined: tuple[int, ...] = ()
    result: Any = None

    @property
    def name(self) -> str:
        return self.request.name

    @property
    def kind(self) -> RequestType:
        return self.request.kind
