"""The one dtype rule (``horovod.common.dtypes``): what each transport's reduction sends for each
dtype, as the module's table says, and what the core refuses for every binding alike."""

from __future__ import annotations

import numpy as np
import pytest

import horovod.numpy as hvd
from horovod.common.backends.local import LocalBackend
from horovod.common.backends.mpi import MPIBackend
from horovod.common.dtypes import REDUCE_DTYPES, check_reduce_op, logical_op, reduce_dtype
from horovod.common.types import ReduceOp

_GLOO = frozenset({"uint8", "int8", "int32", "int64", "float16", "float32", "float64"})  # + bfloat16 with torch 2.x
_NCCL = frozenset({"uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64"})

# dtype -> (MPI, Gloo without bfloat16, NCCL): the module docstring's table
TABLE = {
    "float16": ("float16", "float16", "float16"),
    "bfloat16": ("bfloat16", "float32", "bfloat16"),
    "float32": ("float32", "float32", "float32"),
    "float64": ("float64", "float64", "float64"),
    "int8": ("int8", "int8", "int8"),
    "uint8": ("uint8", "uint8", "uint8"),
    "int16": ("int16", "int32", "int32"),
    "uint16": ("uint16", "int32", "int32"),
    "int32": ("int32", "int32", "int32"),
    "int64": ("int64", "int64", "int64"),
    "uint32": ("uint32", None, None),
    "uint64": ("uint64", None, None),
    "bool": ("uint8", "uint8", "uint8"),
}


def test_every_reducible_dtype_is_in_the_table() -> None:
    assert set(TABLE) == set(REDUCE_DTYPES)


@pytest.mark.parametrize("dtype", sorted(TABLE))
def test_what_crosses_the_wire_per_transport(dtype: str) -> None:
    mpi = MPIBackend.reduce_dtypes(None)  # type: ignore[arg-type]  # a constant of the class
    for native, want in zip((mpi, _GLOO, _NCCL), TABLE[dtype]):
        if want is None:
            with pytest.raises(TypeError, match=f"cannot reduce {dtype}"):
                reduce_dtype(dtype, native, "GLOO")
        else:
            assert reduce_dtype(dtype, native) == want
    assert reduce_dtype("bfloat16", _GLOO | {"bfloat16"}) == "bfloat16"  # torch 2.x's Gloo


def test_bool_reduces_with_logical_ops_and_has_no_average() -> None:
    assert [logical_op("bool", op) for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT)] == \
        [ReduceOp.MAX, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.MIN]
    assert logical_op("uint8", ReduceOp.SUM) == ReduceOp.SUM
    with pytest.raises(ValueError, match="not defined for bool"):
        check_reduce_op("bool", ReduceOp.AVERAGE, "allreduce")
    check_reduce_op("bool", ReduceOp.SUM, "allreduce")


def test_the_host_engine_reduces_bool_through_uint8() -> None:
    """bool on the host path (any binding's NumPy arrays): widened to uint8 on the way in, reduced
    with logical ops, narrowed back: the caller gets bool, in place too."""
    assert "bool" not in LocalBackend.reduce_dtypes(None)  # type: ignore[arg-type]
    hvd.init()
    try:
        x = np.array([True, False, True])
        for op in (hvd.Sum, hvd.Min, hvd.Max, hvd.Product):
            got = hvd.allreduce(x, op=op, name=f"b{op}")
            assert got.dtype == np.bool_ and got.tolist() == [True, False, True]
        y = x.copy()
        hvd.allreduce_(y, op=hvd.Sum, name="inplace")
        assert y.dtype == np.bool_ and y.tolist() == [True, False, True]
        with pytest.raises(ValueError, match="not defined for bool"):
            hvd.allreduce(x, name="avg")
        rs = hvd.reducescatter(np.array([[True], [False]]), op=hvd.Sum, name="rs")
        assert rs.dtype == np.bool_ and rs.tolist() == [[True], [False]]
    finally:
        hvd.shutdown()
