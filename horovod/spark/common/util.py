"""Data preparation: a DataFrame's feature, label and weight columns written as Parquet into the
store, with the metadata (kind, shape, dtype of every column) the readers and models need.

Column kinds: Spark ML vectors (dense or sparse; stored as ``array<double>``, or as
``(indices, values)`` with ``compress_sparse_cols=True``), arrays of numbers, and numeric or boolean
scalars. Anything else (strings, maps, nested arrays, rows of different lengths) is refused here,
before any training starts, with the column's name and type.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
from typing import Any

from horovod.spark.common import constants
from horovod.spark.common.store import METADATA_FILE, AbstractFilesystemStore
from horovod.spark.common.types import (
    data_type_to_numpy,
    data_type_to_str,
    numpy_type_to_str,
    pyarrow_to_spark_data_type,
    spark_scalar_to_python_type,
)

__all__ = ["prepare_data", "get_dataset_properties", "check_columns", "column_metadata",
           "read_data_metadata", "DataPreparationError",
           # upstream's helpers
           "host_hash", "data_type_to_str", "numpy_type_to_str", "spark_scalar_to_python_type",
           "pyarrow_to_spark_data_type", "data_type_to_numpy", "check_shape_compatibility", "check_feature_shapes",
           "check_validation", "clear_training_cache", "to_list", "is_databricks", "get_output_cols",
           "get_spark_df_output_schema", "get_simple_meta_from_parquet", "to_petastorm_fn"]

_NUMERIC = {"ByteType": "int8", "ShortType": "int16", "IntegerType": "int32", "LongType": "int64",
            "FloatType": "float32", "DoubleType": "float64", "BooleanType": "bool"}
_SPARSE_SUFFIX = ("__sparse_indices", "__sparse_values")

# Prepared datasets of this process: key of (DataFrame plan, columns, options) -> dataset index.
_PREPARED: dict[str, str] = {}
# Dataset index -> the store it was written to (upstream's one-argument get_dataset_properties).
_STORES: dict[str, AbstractFilesystemStore] = {}


class DatasetIndex(str):
    """The index ``prepare_data`` returns: a string, usable as upstream's context manager too
    (``with util.prepare_data(...) as idx:``)."""

    def __enter__(self) -> DatasetIndex:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class DataPreparationError(ValueError):
    """A column is missing or has a type, shape or content the estimators cannot train on."""


def check_columns(df: Any, columns: list[str], role: dict[str, str]) -> None:
    """Every name in ``columns`` is a column of ``df``; else an error naming the missing ones."""
    have = list(df.columns)
    missing = [c for c in columns if c not in have]
    if missing:
        roles = ", ".join(f"{c!r} ({role.get(c, 'column')})" for c in missing)
        raise DataPreparationError(
            f"Column(s) {roles} not found in the DataFrame, whose columns are {have}. "
            "Check feature_cols / label_cols / sample_weight_col / validation.")


def column_metadata(df: Any, columns: list[str], compress_sparse: bool = False) -> dict[str, Any]:
    """Kind, element dtype and shape of each column; one Spark pass measures vector/array sizes
    (every row of a column must have the same size)."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType

    fields = {f.name: f.dataType for f in df.schema.fields}
    meta: dict[str, Any] = {}
    sized: list[str] = []
    for c in columns:
        dt = fields[c]
        kind = type(dt).__name__
        if isinstance(dt, VectorUDT):
            meta[c] = {"kind": "vector", "dtype": "float64", "spark_data_type": "Vector"}
            sized.append(c)
        elif isinstance(dt, ArrayType):
            elem = type(dt.elementType).__name__
            if elem not in _NUMERIC:
                raise DataPreparationError(
                    f"Column {c!r} is {dt.simpleString()}: arrays must hold numbers or booleans "
                    "(nested arrays: flatten them and give the model's input_shapes).")
            meta[c] = {"kind": "array", "dtype": _NUMERIC[elem], "spark_data_type": dt.simpleString()}
            sized.append(c)
        elif kind in _NUMERIC:
            meta[c] = {"kind": "scalar", "dtype": _NUMERIC[kind], "shape": [],
                       "spark_data_type": dt.simpleString()}
        else:
            raise DataPreparationError(
                f"Column {c!r} is {dt.simpleString()}, which the estimators cannot feed to a model: "
                "use numbers, booleans, arrays of numbers or Spark ML vectors (encode strings "
                "with StringIndexer/OneHotEncoder first).")
    if sized:
        from pyspark.ml.functions import vector_to_array

        aggs = []
        for c in sized:
            arr = vector_to_array(F.col(c)) if meta[c]["kind"] == "vector" else F.col(c)
            aggs += [F.min(F.size(arr)).alias(f"{c}__min"), F.max(F.size(arr)).alias(f"{c}__max")]
        row = df.agg(*aggs).collect()[0].asDict()
        for c in sized:
            lo, hi = row[f"{c}__min"], row[f"{c}__max"]
            if lo is None or hi is None or lo < 0:
                raise DataPreparationError(f"Column {c!r} has null values or no rows.")
            if lo != hi:
                raise DataPreparationError(
                    f"Column {c!r} has rows of different lengths ({lo} to {hi}); every row of a "
                    "feature or label must have the same shape.")
            meta[c]["shape"] = [int(lo)]
    for c in columns:
        if meta[c]["kind"] == "vector":
            meta[c]["sparse"] = bool(compress_sparse)
    return meta


def _dataset_key(df: Any, columns: list[str], options: dict[str, Any]) -> str:
    try:
        # semanticHash ignores expression ids: the same data and query built again match
        fingerprint = str(df._jdf.queryExecution().analyzed().semanticHash())
    except Exception:  # noqa: BLE001 - Spark Connect: no JVM plan; reuse by object identity
        fingerprint = f"id:{id(df)}"
    blob = json.dumps([fingerprint, df.schema.json(), columns, options], sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def prepare_data(num_processes: int, store: AbstractFilesystemStore, df: Any,
                 label_columns: list[str], feature_columns: list[str],
                 validation: float | str | None = None, sample_weight_col: str | None = None,
                 compress_sparse: bool = False, partitions_per_process: int = 10,
                 verbose: int = 0) -> str:
    """Write ``df``'s columns as Parquet into ``store`` (train and validation sets) and return the
    dataset index (``store.get_train_data_path(idx)``). The same DataFrame with the same options
    in the same process reuses the data already written. The index is also a context manager, as
    upstream's ``prepare_data`` was: ``with prepare_data(...) as idx:``."""
    roles = {**{c: "feature" for c in feature_columns}, **{c: "label" for c in label_columns}}
    columns = list(dict.fromkeys(feature_columns + label_columns))
    if sample_weight_col:
        roles[sample_weight_col] = "sample weight"
        columns.append(sample_weight_col)
    val_col = validation if isinstance(validation, str) else None
    if val_col:
        roles[val_col] = "validation"
    check_columns(df, columns + ([val_col] if val_col else []), roles)
    if validation is not None and not isinstance(validation, str):
        if not 0 <= float(validation) < 1:
            raise DataPreparationError(f"validation={validation}: a fraction must be in [0, 1).")
    options = {"validation": validation, "compress_sparse": compress_sparse,
               "partitions": num_processes * partitions_per_process, "store": store.prefix_path}
    key = _dataset_key(df, columns, options)
    idx = _PREPARED.get(key)
    if idx is not None and store.is_complete(store.get_train_data_path(idx)):
        if verbose:
            print(f"horovod.spark: reusing prepared data {store.get_train_data_path(idx)}")
        return DatasetIndex(idx)
    idx = key
    meta = column_metadata(df, columns, compress_sparse)
    _write(store, df, idx, columns, meta, validation, num_processes * partitions_per_process)
    _PREPARED[key] = idx
    _STORES[idx] = store
    return DatasetIndex(idx)


def _write(store: AbstractFilesystemStore, df: Any, idx: str, columns: list[str],
           meta: dict[str, Any], validation: float | str | None, partitions: int) -> None:
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    def converted(frame: Any) -> Any:
        out = []
        for c in columns:
            m = meta[c]
            if m["kind"] == "vector" and m.get("sparse"):
                out += _sparse_parts(c)
            elif m["kind"] == "vector":
                out.append(vector_to_array(F.col(c)).alias(c))
            else:
                out.append(F.col(c))
        return frame.select(*out)

    train_path, val_path = store.get_train_data_path(idx), store.get_val_data_path(idx)
    for p in (train_path, val_path):
        store.rmtree(p)
    if isinstance(validation, str):
        flag = F.col(validation).cast("double")
        train_df, val_df = df.where((flag == 0) | flag.isNull()), df.where(flag > 0)
        val_part = partitions // 4 or 1
    elif validation:
        train_df, val_df = df.randomSplit([1.0 - float(validation), float(validation)], seed=17)
        val_part = max(1, math.ceil(partitions * float(validation)))
    else:
        train_df, val_df, val_part = df, None, 0
    train_df = converted(train_df).repartition(partitions)
    writer = train_df.write.mode("overwrite").option("parquet.block.size", 8 << 20)
    writer.parquet(store.spark_path(train_path))
    train_rows = _rows(store, train_path)
    val_rows = 0
    if val_df is not None:
        converted(val_df).repartition(val_part).write.mode("overwrite") \
            .option("parquet.block.size", 8 << 20).parquet(store.spark_path(val_path))
        val_rows = _rows(store, val_path)
    if train_rows == 0:
        raise DataPreparationError("No training rows: the DataFrame is empty, or every row is "
                                   f"marked for validation ({validation!r}).")
    info = {"metadata": meta, "train_rows": train_rows, "val_rows": val_rows, "columns": columns}
    if val_rows:
        store.write_json(store.join(val_path, METADATA_FILE), info)
    store.write_json(store.join(train_path, METADATA_FILE), info)  # last: marks it complete


def _sparse_parts(c: str) -> list[Any]:
    from pyspark.sql import functions as F

    @F.udf("struct<i:array<int>,v:array<double>>")
    def parts(v: Any) -> Any:
        from pyspark.ml.linalg import SparseVector

        if isinstance(v, SparseVector):
            return (v.indices.tolist(), v.values.tolist())
        nz = [i for i, x in enumerate(v) if x != 0]
        return (nz, [float(v[i]) for i in nz])

    s = parts(F.col(c))
    return [s["i"].alias(c + _SPARSE_SUFFIX[0]), s["v"].alias(c + _SPARSE_SUFFIX[1])]


def _rows(store: AbstractFilesystemStore, path: str) -> int:
    import pyarrow.parquet as pq

    total = 0
    for f in store.list_parquet_files(path):
        with store.fs.open_input_file(f) as fh:
            total += pq.ParquetFile(fh).metadata.num_rows
    return total


def read_data_metadata(store: AbstractFilesystemStore, idx: Any) -> dict[str, Any]:
    """The metadata of prepared data; Parquet written by other means gets it from its schema."""
    path = store.get_train_data_path(idx)
    if store.is_complete(path):
        return dict(store.read_json(store.join(path, METADATA_FILE)))
    files = store.list_parquet_files(path) if store.exists(path) else []
    if not files:
        raise DataPreparationError(
            f"No prepared data at {path}: it was never written, or its writing did not finish "
            f"(no {METADATA_FILE}). Call fit(df) to prepare it, or write Parquet files there.")
    return _metadata_from_parquet(store, path, files)


def _metadata_from_parquet(store: AbstractFilesystemStore, path: str,
                           files: list[str]) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with store.fs.open_input_file(files[0]) as fh:
        pf = pq.ParquetFile(fh)
        schema = pf.schema_arrow
        first = pf.read_row_group(0) if pf.num_row_groups else None
    meta: dict[str, Any] = {}
    for field in schema:
        t = field.type
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            n = len(first.column(field.name)[0]) if first is not None and first.num_rows else 0
            meta[field.name] = {"kind": "array", "dtype": t.value_type.to_pandas_dtype().__name__,
                                "shape": [n], "spark_data_type": str(t)}
        else:
            meta[field.name] = {"kind": "scalar", "dtype": t.to_pandas_dtype().__name__,
                                "shape": [], "spark_data_type": str(t)}
    train_rows = _rows(store, path)
    val_path = path.replace(store.get_train_data_path(), store.get_val_data_path(), 1)
    val_rows = _rows(store, val_path) if store.exists(val_path) else 0
    return {"metadata": meta, "train_rows": train_rows, "val_rows": val_rows,
            "columns": list(meta)}


def get_dataset_properties(store: Any, idx: Any = None) -> tuple[Any, ...]:
    """``(train_rows, val_rows, metadata)`` of prepared data; upstream's one-argument form
    ``get_dataset_properties(idx)`` (an index this process prepared) gives upstream's
    ``(train_rows, val_rows, metadata, avg_row_size)``."""
    if idx is None and not isinstance(store, AbstractFilesystemStore):
        idx = store
        if idx not in _STORES:
            raise DataPreparationError(f"Dataset index {idx!r} was not prepared by this process; "
                                       "call get_dataset_properties(store, idx) with its store.")
        info = read_data_metadata(_STORES[idx], idx)
        return (info["train_rows"], info["val_rows"], info["metadata"],
                _avg_row_size(_STORES[idx], _STORES[idx].get_train_data_path(idx)))
    info = read_data_metadata(store, idx)
    return info["train_rows"], info["val_rows"], info["metadata"]


def _avg_row_size(store: AbstractFilesystemStore, path: str) -> float:
    import pyarrow.parquet as pq

    rows = size = 0
    for f in store.list_parquet_files(path):
        with store.fs.open_input_file(f) as fh:
            md = pq.ParquetFile(fh).metadata
        rows += md.num_rows
        size += sum(md.row_group(i).total_byte_size for i in range(md.num_row_groups))
    return size / rows if rows else 0.0


# ---------------------------------------------------------------------------- upstream's helpers
def host_hash(salt: Any = None) -> str:
    """This host's identity for grouping tasks: the host name and a hash of its kernel
    namespaces (containers on one host differ), of ``CONTAINER_ID`` (a YARN container is a host
    of its own) and of ``salt``."""
    parts = [str(salt)] if salt else []
    if os.environ.get("CONTAINER_ID") is not None:
        parts.append(os.environ["CONTAINER_ID"])
    for ns in ("mnt", "pid", "net", "uts", "ipc"):
        try:
            parts.append(os.readlink(f"/proc/self/ns/{ns}"))
        except OSError:
            pass
    digest = hashlib.md5("-".join(parts).encode(), usedforsecurity=False).hexdigest()
    return f"{socket.gethostname()}-{digest}"


def is_databricks() -> bool:
    return "DATABRICKS_RUNTIME_VERSION" in os.environ


def to_list(var: Any, length: int) -> list[Any] | None:
    """``var`` as a list of ``length`` items (one item is repeated); ``None`` stays ``None``."""
    if var is None:
        return None
    if not isinstance(var, list):
        var = [var]
    if len(var) == 1:
        return var * length
    if len(var) != length:
        raise ValueError(f"List {var} must be length {length} (found: {len(var)})")
    return var


def check_validation(validation: Any, df: Any = None) -> None:
    """``validation`` is a fraction in [0, 1) or the name of a column of ``df``."""
    if not validation:
        return
    if isinstance(validation, float):
        if not 0 <= validation < 1:
            raise ValueError(f"Validation split {validation} must be in the range: [0, 1)")
    elif isinstance(validation, str):
        if df is not None and validation not in df.columns:
            raise ValueError(f"Validation column {validation} does not exist in the DataFrame")
    else:
        raise ValueError(f'Param validation must be of type "float" or "str", found: {type(validation)}')


def _col_size(meta: dict[str, Any]) -> int | None:
    shape = meta.get("shape")
    if shape is None:
        return None
    return int(math.prod(shape)) if isinstance(shape, (list, tuple)) else int(shape)


def check_feature_shapes(metadata: dict[str, Any], feature_cols: list[str], shapes: list[list[int]],
                         source: str) -> None:
    """Each feature column's values per row match the element count of its entry in ``shapes``
    (``-1``/None, a batch dimension, is not counted); ``source`` names the shapes in errors.

    Raises:
        DataPreparationError: a count of shapes or of values that differs (before training).
    """
    if len(shapes) != len(feature_cols):
        raise DataPreparationError(f"{source} has {len(shapes)} shape(s) for {len(feature_cols)} feature "
                                   f"column(s) {feature_cols}.")
    for col, shape in zip(feature_cols, shapes):
        have = int(math.prod(metadata[col]["shape"])) if metadata[col]["shape"] else 1
        want = int(math.prod([d for d in shape if d not in (-1, None)]))
        if want != have:
            raise DataPreparationError(
                f"Feature column {col!r} has {have} value(s) per row, but {source} gives it shape "
                f"{list(shape)} ({want} values per row). Fix {source} or the column.")


def check_shape_compatibility(metadata: dict[str, Any], feature_columns: list[str],
                              label_columns: list[str], input_shapes: Any = None,
                              output_shapes: Any = None, label_shapes: Any = None) -> None:
    """Each column's element count equals that of its model input, output or label shape."""
    def sizes(cols: list[str], shapes: Any, what: str, kind: str) -> None:
        for i, (col, shape) in enumerate(zip(cols, shapes)):
            have = _col_size(metadata[col])
            want = abs(int(math.prod(shape)))
            if have is not None and have != want:
                raise ValueError(f"{kind} column '{col}' with size {have} must equal that of the "
                                 f"{what} at index {i} with size {want}")

    if input_shapes is not None:
        if len(feature_columns) != len(input_shapes):
            raise ValueError(f"Feature column count {len(feature_columns)} must equal model inputs "
                             f"count {len(input_shapes)}")
        sizes(feature_columns, input_shapes, "model input", "Feature")
    if label_shapes is not None and len(label_columns) != len(label_shapes):
        raise ValueError(f"Label column count {len(label_columns)} must equal provided label shapes "
                         f"count {len(label_shapes)}")
    if output_shapes is not None and len(label_columns) != len(output_shapes):
        raise ValueError(f"Label column count {len(label_columns)} must equal model outputs count "
                         f"{len(output_shapes)}")
    if label_shapes is not None:
        sizes(label_columns, label_shapes, "label shape", "Label")
    elif output_shapes is not None:
        sizes(label_columns, output_shapes, "model output shape", "Label")


def clear_training_cache() -> None:
    """Forget the data this process prepared (the next ``fit`` writes it again)."""
    _PREPARED.clear()
    _STORES.clear()


def get_output_cols(input_df_schema: Any, output_cols: list[str]) -> list[str]:
    return [f.name for f in input_df_schema.fields] + list(output_cols)


def _spark_type(value: Any) -> Any:
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql.types import DataType, _parse_datatype_string

    if isinstance(value, type):
        return VectorUDT() if value.__name__ in ("DenseVector", "SparseVector", "VectorUDT") else value()
    if isinstance(value, DataType):
        return value
    if value in ("Vector", "vector"):
        return VectorUDT()
    return _parse_datatype_string(str(value))


def get_spark_df_output_schema(input_df_schema: Any, label_cols: list[str], output_cols: list[str],
                               metadata: dict[str, Any]) -> Any:
    """The input schema plus one output column per label column, of the label's type."""
    from pyspark.sql.types import StructField, StructType

    if len(label_cols) != len(output_cols):
        raise ValueError("Number of output columns must equal to number of label columns.")
    have = {f.name for f in input_df_schema.fields}
    for col in output_cols:
        if col in have:
            raise ValueError(f"Output col '{col}' exists in original df schema: {have}")
    fields = list(input_df_schema.fields)
    for label, out in zip(label_cols, output_cols):
        fields.append(StructField(out, _spark_type(metadata[label]["spark_data_type"]), True))
    return StructType(fields)


def get_simple_meta_from_parquet(store: AbstractFilesystemStore, label_columns: list[str],
                                 feature_columns: list[str], sample_weight_col: str | None,
                                 dataset_idx: Any = None) -> tuple[int, int, dict[str, Any], float]:
    """Upstream's metadata of Parquet data already in the store (no DataFrame):
    ``(train_rows, val_rows, metadata, avg_row_size)``."""
    import pyarrow.parquet as pq

    path = store.get_train_data_path(dataset_idx)
    if not store.exists(path):
        raise ValueError(f"{path} path does not exist in the store")
    files = store.list_parquet_files(path)
    if not files:
        raise ValueError(f"{path} holds no Parquet files")
    with store.fs.open_input_file(files[0]) as fh:
        schema = pq.ParquetFile(fh).schema_arrow
    cols = list(feature_columns) + list(label_columns) + ([sample_weight_col] if sample_weight_col else [])
    metadata = {c: {"spark_data_type": pyarrow_to_spark_data_type(schema.field(c).type),
                    "is_sparse_vector_only": False, "shape": None,
                    "intermediate_format": constants.NOCHANGE, "max_size": None} for c in cols}
    val_path = store.get_val_data_path(dataset_idx)
    val_rows = _rows(store, val_path) if store.exists(val_path) else 0
    return _rows(store, path), val_rows, metadata, _avg_row_size(store, path)


def to_petastorm_fn(schema_cols: list[str], metadata: dict[str, Any] | None) -> Any:
    """A row function that turns the Spark ML vectors of ``schema_cols`` into lists (``ARRAY``)
    or ``[n, indices..., values..., zero padding]`` (``CUSTOM_SPARSE``), as upstream wrote them."""
    def to_petastorm(row: Any) -> Any:
        import numpy as np
        from pyspark import Row
        from pyspark.ml.linalg import SparseVector, Vector

        converted = {}
        for col in schema_cols:
            value = row[col]
            if not isinstance(value, Vector):
                continue
            fmt = metadata[col]["intermediate_format"] if metadata else constants.ARRAY
            if fmt == constants.ARRAY:
                converted[col] = value.toArray().tolist()
            elif fmt == constants.CUSTOM_SPARSE:
                indices: np.ndarray
                values: np.ndarray
                if isinstance(value, SparseVector):
                    indices, values = value.indices, value.values
                else:  # a dense vector in a column of sparse ones
                    dense = value.toArray()
                    indices = np.flatnonzero(dense)
                    values = dense[indices]
                pad = 2 * (metadata[col]["max_size"] - len(indices))  # type: ignore[index]
                converted[col] = np.concatenate(([len(indices)], indices, values, np.zeros(pad))).tolist()
        if not converted:
            return row
        d = row.asDict()
        d.update(converted)
        return Row(**d)

    return to_petastorm
