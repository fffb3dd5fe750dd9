"""Open MPI (or any MPI) through mpi4py: negotiation and CPU collectives.

The engine thread is the only caller. Negotiation's bit-vector AND is non-blocking and polled with
a short spin then a growing sleep, so a rank waiting for a slower peer does not burn a core the
way a blocking MPI collective would; data collectives are blocking (every member is already known
to be at the same operation when they run).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from horovod.common import plain
from horovod.common.backends.base import LOCAL_REDUCE, Group, PartsBuffer
from horovod.common.backends.half import HALF_CHARS, kernel
from horovod.common.dtypes import HALF_DTYPES
from horovod.common.exceptions import HorovodInternalError
from horovod.common.types import ReduceOp

__all__ = ["MPIBackend"]

# Waiting for a slower peer: poll in a tight loop for a short while (ranks usually arrive within
# microseconds of each other), then sleep in growing steps (no core burnt while a peer computes).
# The spin does not yield: time.sleep(0) costs ~60 us here (timer slack), ten times a round.
_SPIN_SECONDS = 100e-6
_MAX_SLEEP = 250e-6


def _fail(rank: int, what: str, exc: Exception) -> HorovodInternalError:
    """The one place where MPI errors become Horovod errors."""
    text = exc.Get_error_string() if hasattr(exc, "Get_error_string") else str(exc)
    err = HorovodInternalError(f"MPI {what} failed on rank {rank}: {text}", rank=rank, op=what)
    err.__cause__ = exc
    return err


@contextlib.contextmanager
def _translate(rank: int, what: str) -> Iterator[None]:
    """Context-manager form of ``_fail`` for the calls that are not on a hot path."""
    from mpi4py import MPI

    try:
        yield
    except MPI.Exception as exc:
        raise _fail(rank, what, exc) from exc


# Reduce-scatters of at least this many bytes of a native MPI dtype run as one ``Alltoallv`` (member
# j receives every member's part j) into a kept buffer, then a local reduction of the p parts in
# member order (``MPIBackend._reducescatter_split``). Open MPI 5's ``Reduce_scatter`` (ring) mallocs
# and frees temporaries of about 1.5 times the whole buffer on every call: 2016 page faults per
# 4 MiB float32 call at np=2 (4 for the 512-page result) and 6627 per 16 MiB call
# (benchmarks/reducescatter_bench.py). Smaller ones are latency-bound and stay MPI's.
SPLIT_REDUCESCATTER_MIN = 1 << 16


class MPIBackend:
    """Controller and collective backend on an mpi4py communicator."""

    name = "mpi"

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self._ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX,
                     ReduceOp.PRODUCT: MPI.PROD}
        self.thread_level = MPI.Query_thread()
        self._bits_out: np.ndarray | None = None
        # (dtype name, op) -> the user-defined MPI operation reducing 16-bit floats (``_half``)
        self._half_ops: dict[tuple[str, ReduceOp], Any] = {}
        self._rs_parts = PartsBuffer()  # ``_reducescatter_split``'s receive buffer

    # ---------------------------------------------------------------- controller
    def and_bits(self, bits: np.ndarray, spin: bool = True) -> np.ndarray:
        out = self._bits_out
        if out is None or out.size != bits.size:
            out = self._bits_out = np.empty_like(bits)
        try:
            req = self.comm.Iallreduce(bits, out, op=self._MPI.BAND)
            if req.Test():
                return out
            if spin:  # a caller waits on a blocking op: answer in microseconds
                start = time.perf_counter()
                while time.perf_counter() - start < _SPIN_SECONDS:
                    if req.Test():
                        return out
            pause = 20e-6
            while not req.Test():
                time.sleep(pause)
                pause = min(pause * 2, _MAX_SLEEP)
        except self._MPI.Exception as exc:
            raise _fail(self.rank, "negotiation", exc) from exc
        return out

    # The controller's messages travel as ``horovod.common.plain`` bytes in buffer collectives
    # (mpi4py's lower-case methods would pickle them: a peer that reached MPI's connections could
    # then run code here). Two collectives each, as mpi4py's own gather and bcast do.
    def gather_to_root(self, obj: Any) -> list[Any] | None:
        data = np.frombuffer(plain.dumps(obj), np.uint8)
        with _translate(self.rank, "negotiation gather"):
            counts = np.zeros(self.size, np.int64) if self.rank == 0 else None
            self.comm.Gather(np.array([data.size], np.int64), counts, root=0)
            if self.rank != 0:
                self.comm.Gatherv(data, None, root=0)
                return None
            assert counts is not None
            recv = np.empty(int(counts.sum()), np.uint8)
            self.comm.Gatherv(data, [recv, counts], root=0)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        return [plain.loads(recv[offsets[i]:offsets[i + 1]]) for i in range(self.size)]

    def bcast_from_root(self, obj: Any) -> Any:
        with _translate(self.rank, "negotiation broadcast"):
            data = np.frombuffer(plain.dumps(obj), np.uint8) if self.rank == 0 else None
            n = np.array([0 if data is None else data.size], np.int64)
            self.comm.Bcast(n, root=0)
            buf = data.copy() if data is not None else np.empty(int(n[0]), np.uint8)
            self.comm.Bcast(buf, root=0)
        return obj if self.rank == 0 else plain.loads(buf)

    def allgather_object(self, obj: Any) -> list[Any]:
        data = np.frombuffer(plain.dumps(obj), np.uint8)
        with _translate(self.rank, "allgather"):
            counts = np.zeros(self.size, np.int64)
            self.comm.Allgather(np.array([data.size], np.int64), counts)
            recv = np.empty(int(counts.sum()), np.uint8)
            self.comm.Allgatherv(data, [recv, counts])
        offsets = np.concatenate([[0], np.cumsum(counts)])
        return [plain.loads(recv[offsets[i]:offsets[i + 1]]) for i in range(self.size)]

    # ---------------------------------------------------------------- groups
    def world_group(self) -> Group:
        return Group(list(range(self.size)), self.rank, self.comm)

    def new_group(self, ranks: list[int]) -> Group:
        MPI = self._MPI
        ranks = sorted(ranks)
        color = 0 if self.rank in ranks else MPI.UNDEFINED
        with _translate(self.rank, "communicator split"):
            sub = self.comm.Split(color, key=self.rank)
        return Group(ranks, self.rank, None if sub == MPI.COMM_NULL else sub)

    def split_group(self, parent: Group, colors: list[int]) -> Group:
        """This member's part of ``parent`` split by color (``colors[i]`` for ``parent.ranks[i]``).

        Collective over ``parent``'s members only; a negative color gives a group without handle.
        """
        MPI = self._MPI
        color = colors[parent.rank]
        with _translate(self.rank, "communicator split"):
            sub = parent.handle.Split(color if color >= 0 else MPI.UNDEFINED, key=parent.rank)
        ranks = [r for r, c in zip(parent.ranks, colors) if c == color] if color >= 0 else []
        return Group(ranks, self.rank, None if sub == MPI.COMM_NULL else sub)

    def free_group(self, group: Group) -> None:
        if group.handle is not None and group.handle != self.comm:
            group.handle.Free()

    def reduce_dtypes(self) -> frozenset[str]:
        # float16 and bfloat16 through user-defined operations (``half``): 16 bits on the wire.
        return frozenset({"uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
                          "float16", "bfloat16", "float32", "float64"})

    def _half(self, dtype: str, op: ReduceOp) -> Any:
        """The MPI operation reducing ``dtype`` (a 16-bit float) with ``op`` over ``MPI.UINT16_T``
        buffers (upstream's ``float16_sum``), made on first use."""
        mop = self._half_ops.get((dtype, op))
        if mop is None:
            run = kernel(dtype, op)
            mop = self._half_ops[(dtype, op)] = self._MPI.Op.Create(
                lambda inbuf, inoutbuf, _datatype: run(inbuf, inoutbuf), commute=True)
        return mop

    def _reduce_args(self, buf: np.ndarray, op: ReduceOp) -> tuple[Any, Any]:
        """``buf`` as MPI sees it and the MPI operation reducing it with ``op``."""
        dt = buf.dtype
        if dt.char in HALF_CHARS and dt.name in HALF_DTYPES:
            return [buf.view(np.uint16), self._MPI.UINT16_T], self._half(dt.name, op)
        return buf, self._ops[op]

    @staticmethod
    def _moved(buf: np.ndarray) -> np.ndarray:
        """``buf`` as data movement sends it (bfloat16 has no MPI type: its bits as uint16)."""
        return buf.view(np.uint16) if buf.dtype.char in HALF_CHARS else buf

    # ---------------------------------------------------------------- collectives
    def allreduce(self, buf: np.ndarray, op: ReduceOp, group: Group, src: np.ndarray | None = None) -> None:
        try:
            recv, mop = self._reduce_args(buf, op)
            send = self._MPI.IN_PLACE if src is None else self._reduce_args(src, op)[0]
            group.handle.Allreduce(send, recv, op=mop)
        except self._MPI.Exception as exc:
            raise _fail(self.rank, "allreduce", exc) from exc

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int], group: Group) -> None:
        with _translate(self.rank, "allgather"):
            group.handle.Allgatherv(self._moved(send), [self._moved(recv), counts])

    def broadcast(self, buf: np.ndarray, root: int, group: Group) -> None:
        with _translate(self.rank, "broadcast"):
            group.handle.Bcast(self._moved(buf), root=root)

    def alltoallv(self, send: np.ndarray, send_counts: list[int], recv: np.ndarray,
                  recv_counts: list[int], group: Group) -> None:
        with _translate(self.rank, "alltoall"):
            group.handle.Alltoallv([self._moved(send), send_counts], [self._moved(recv), recv_counts])

    def reducescatter(self, send: np.ndarray, recv: np.ndarray, counts: list[int], op: ReduceOp,
                      group: Group) -> None:
        flat = send.reshape(-1)
        if (group.size > 1 and flat.nbytes >= SPLIT_REDUCESCATTER_MIN and op in LOCAL_REDUCE
                and flat.dtype.char not in HALF_CHARS and flat.size == sum(counts)):
            self._reducescatter_split(flat, recv.reshape(-1), counts, op, group)
            return
        self._reducescatter_native(send, recv, counts, op, group)

    def _reducescatter_native(self, send: np.ndarray, recv: np.ndarray, counts: list[int], op: ReduceOp,
                              group: Group) -> None:
        """MPI's own ``Reduce_scatter`` (small buffers, 16-bit floats)."""
        with _translate(self.rank, "reducescatter"):
            sendbuf, mop = self._reduce_args(send, op)
            group.handle.Reduce_scatter(sendbuf, self._reduce_args(recv, op)[0], recvcounts=counts, op=mop)

    def _reducescatter_split(self, flat: np.ndarray, recv: np.ndarray, counts: list[int], op: ReduceOp,
                             group: Group) -> None:
        """One ``Alltoallv`` into a kept ``(p, counts[rank])`` buffer and a reduction of the p parts
        in member order (the same sum on whichever member computes a part; integers wrap as MPI's)."""
        p, mine = group.size, counts[group.rank]
        pieces = self._rs_parts.parts(p, mine, flat.dtype)
        with _translate(self.rank, "reducescatter"):
            group.handle.Alltoallv([flat, counts], [pieces.reshape(-1), [mine] * p])
        if mine:
            LOCAL_REDUCE[op].reduce(pieces, axis=0, dtype=flat.dtype, out=recv[:mine])

    def allgather_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        values = np.ascontiguousarray(values, np.int64)
        out = np.empty((group.size, values.size), np.int64)
        with _translate(self.rank, "allgather"):
            group.handle.Allgather(values, out)
        return out

    def alltoall_ints(self, values: np.ndarray, group: Group) -> np.ndarray:
        values = np.ascontiguousarray(values, np.int64)
        out = np.empty(group.size, np.int64)
        with _translate(self.rank, "alltoall"):
            group.handle.Alltoall(values, out)
        return out

    def barrier(self, group: Group) -> None:
        with _translate(self.rank, "barrier"):
            group.handle.Barrier()

    def sendrecv(self, send: np.ndarray, recv: np.ndarray, peer: int, group: Group) -> None:
        with _translate(self.rank, "sendrecv"):
            group.handle.Sendrecv(send.reshape(-1).view(np.uint8), peer, 0,
                                  recv.reshape(-1).view(np.uint8), peer, 0)

    def close(self) -> None:
        # The duplicated communicator is freed; MPI itself stays initialized so that a later
        # hvd.init() works (MPI cannot be initialized twice in one process).
        with contextlib.suppress(Exception):
            self.comm.Free()
