"""Spark, NumPy and Arrow data types named the way upstream's ``horovod.spark.common.util`` names
them (``data_type_to_str``, ``data_type_to_numpy``, ...). Each function takes a Spark type class
or instance (``DoubleType`` or ``DoubleType()``) and raises ``ValueError`` naming a type it does
not know. ``horovod.spark.common.util`` re-exports them."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["data_type_to_str", "numpy_type_to_str", "spark_scalar_to_python_type",
           "pyarrow_to_spark_data_type", "data_type_to_numpy"]


def _name(dtype: Any) -> str:
    cls = dtype if isinstance(dtype, type) else type(dtype)
    return cls.__name__


_VECTORS = ("VectorUDT", "SparseVector", "DenseVector")
_STR = {"IntegerType": "Int", "StringType": "String", "FloatType": "Float", "BinaryType": "Binary",
        "DoubleType": "Double", "LongType": "Long", "BooleanType": "Boolean"}
_PYTHON = {"IntegerType": int, "StringType": str, "FloatType": float, "DoubleType": float,
           "LongType": int, "BooleanType": bool, "BinaryType": bytes}
_NUMPY = {"ArrayType": np.float64, "IntegerType": np.int32, "StringType": np.str_,
          "FloatType": np.float32, "BinaryType": np.uint8, "DoubleType": np.float64,
          "LongType": np.int64, "BooleanType": np.bool_}


def data_type_to_str(dtype: Any) -> str:
    """``"Vector"``, ``"Int"``, ``"String"``, ``"Float"``, ``"Binary"``, ``"Double"``, ``"Long"``
    or ``"Boolean"`` for a Spark type (or an ML vector class)."""
    name = _name(dtype)
    if name in _VECTORS:
        return "Vector"
    if name in _STR:
        return _STR[name]
    raise ValueError(f"Unrecognized data type: {dtype}")


def numpy_type_to_str(dtype: Any) -> str:
    """The same names for a NumPy dtype."""
    names = {np.dtype(np.int32): "Int", np.dtype(np.float32): "Float", np.dtype(np.uint8): "Binary",
             np.dtype(np.float64): "Double", np.dtype(np.int64): "Long", np.dtype(np.bool_): "Boolean"}
    try:
        return names[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise ValueError(f"Cannot convert numpy data type to Spark string: {dtype}") from None


def spark_scalar_to_python_type(dtype: Any) -> type:
    """``int``, ``str``, ``float``, ``bool`` or ``bytes`` for a scalar Spark type."""
    try:
        return _PYTHON[_name(dtype)]
    except KeyError:
        raise ValueError(f"cannot convert Spark data Type {dtype} to native python type") from None


def pyarrow_to_spark_data_type(dtype: Any) -> type:
    """The Spark type class of an Arrow type; Arrow lists are ML ``DenseVector`` (as upstream)."""
    import pyarrow as pa
    from pyspark.ml.linalg import DenseVector
    from pyspark.sql.pandas.types import from_arrow_type

    if pa.types.is_list(dtype) or pa.types.is_large_list(dtype):
        return DenseVector
    return type(from_arrow_type(dtype))


def data_type_to_numpy(dtype: Any) -> type:
    """The NumPy scalar type of a Spark type (vectors and arrays: ``float64``)."""
    name = _name(dtype)
    if name in _VECTORS:
        return np.float64
    try:
        return _NUMPY[name]
    except KeyError:
        raise ValueError(f"Unrecognized data type: {dtype}") from None
