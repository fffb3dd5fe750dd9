"""The dtype rules, once: what each operation takes, and what a reduction sends over each transport.

Every binding (NumPy, torch, TensorFlow, JAX) hands the engine its tensors in their own dtype, as
NumPy arrays (``bfloat16`` as ``ml_dtypes.bfloat16``, a dependency of the package) or as a device
plane's buffers; no binding widens anything. What crosses the wire is decided here, per transport,
from the dtypes its library reduces natively (``CollectiveBackend.reduce_dtypes``, a device
plane's ``Transport.native``), by ``reduce_dtype``:

======================  ===========================  ============================  ==========================
tensor dtype            MPI                          Gloo                          NCCL (torch device plane)
======================  ===========================  ============================  ==========================
float16                 float16 (``half``'s ops)     float16                       float16
bfloat16                bfloat16 (``half``'s ops)    bfloat16 where torch's Gloo   bfloat16
                                                     reduces it, else float32
float32, float64        itself                       itself                        itself
int8, uint8             itself                       itself                        itself
int16, uint16           itself                       int32                         int32
int32, int64            itself                       itself                        itself
uint32, uint64          itself                       refused (``TypeError``)       refused
bool                    uint8, logical ops           uint8, logical ops            uint8, logical ops
======================  ===========================  ============================  ==========================

A widened reduction is packed into the wide type, reduced, and narrowed back into the tensors'
dtype by the engine (``buffers``): the caller gets its own dtype back. bool reduces with logical
semantics (Sum and Max are or, Min and Product are and: ``logical_op``); its Average has no
meaning and is refused (``check_reduce_op``). Adasum sends its dtypes as they are (it exchanges
vectors, the transport reduces nothing). Data movement (allgather, broadcast, alltoall) sends any
dtype as unsigned integers of its size.
"""

from __future__ import annotations

import functools

from horovod.common.types import ReduceOp

__all__ = ["HALF_DTYPES", "FLOAT_DTYPES", "ADASUM_DTYPES", "REDUCE_DTYPES", "MOVE_DTYPES",
           "reduce_dtype", "logical_op", "check_reduce_op"]

#: the 16-bit floats (``backends.half`` reduces them where the library has no arithmetic of its own)
HALF_DTYPES = frozenset({"float16", "bfloat16"})
#: the float dtypes: reduced in float32 where the transport has no arithmetic of their own
FLOAT_DTYPES = HALF_DTYPES | {"float32", "float64"}
#: what Adasum combines (upstream's CPU Adasum: no bfloat16)
ADASUM_DTYPES = FLOAT_DTYPES - {"bfloat16"}
#: what reductions (allreduce, reducescatter) take
REDUCE_DTYPES = FLOAT_DTYPES | {"uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
                                "bool"}
#: what data movement (allgather, broadcast, alltoall) takes
MOVE_DTYPES = REDUCE_DTYPES


@functools.lru_cache(maxsize=256)
def reduce_dtype(dtype: str, native: frozenset[str], transport: str = "") -> str:
    """The dtype a reduction of ``dtype`` runs in (and crosses the wire in) on a transport that
    reduces ``native``: the one widening rule (the module's table). Itself when native; bool as
    uint8 (with ``logical_op``); a float in float32; a narrow integer in int32.

    Raises:
        TypeError: no dtype the transport reduces can hold ``dtype``'s values.
    """
    if dtype in native:
        return dtype
    if dtype == "bool" and "uint8" in native:
        return "uint8"
    if dtype in FLOAT_DTYPES and "float32" in native:
        return "float32"
    if dtype in ("int8", "uint8", "int16", "uint16") and "int32" in native:
        return "int32"
    raise TypeError(f"the {transport or 'data'} transport cannot reduce {dtype} tensors (it reduces "
                    f"{', '.join(sorted(native))}); convert them to one of those dtypes")


_LOGICAL = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.MAX: ReduceOp.MAX, ReduceOp.MIN: ReduceOp.MIN,
            ReduceOp.PRODUCT: ReduceOp.MIN}


def logical_op(dtype: str, op: ReduceOp) -> ReduceOp:
    """The transport's op for ``op`` on ``dtype``: bool reduces with logical semantics (Sum and Max
    are or, Min and Product are and) on its uint8 widening."""
    return _LOGICAL.get(op, op) if dtype == "bool" else op


def check_reduce_op(dtype: str, op: ReduceOp, what: str) -> None:
    """Refuse a reduction that has no meaning on ``dtype``.

    Raises:
        ValueError: Average of bool tensors.
    """
    if dtype == "bool" and op == ReduceOp.AVERAGE:
        raise ValueError(f"{what}: op=Average is not defined for bool tensors; use op=hvd.Sum or "
                         "hvd.Max (logical or) or hvd.Min (logical and).")
