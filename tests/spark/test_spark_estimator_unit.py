"""Estimator parts without a Spark cluster: the store, the pyarrow reader, the parameters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.unit

pytest.importorskip("pyspark")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def test_store_create_and_layout(tmp_path: Path) -> None:
    from horovod.spark.common.store import DBFSLocalStore, FilesystemStore, HDFSStore, LocalStore, Store

    local = Store.create(str(tmp_path / "s"))
    assert type(local) is LocalStore and local.prefix_path == str(tmp_path / "s")
    assert local.get_train_data_path(3) == f"{tmp_path}/s/intermediate_train_data.3"
    assert local.get_val_data_path() == f"{tmp_path}/s/intermediate_val_data"
    assert local.get_test_data_path(0) == f"{tmp_path}/s/intermediate_test_data.0"
    assert local.get_checkpoint_path("r1") == f"{tmp_path}/s/runs/r1/checkpoint"
    assert local.get_logs_path("r1") == f"{tmp_path}/s/runs/r1/logs"
    hdfs = Store.create("hdfs://nn:8020/user/x")
    assert type(hdfs) is HDFSStore and hdfs.get_runs_path() == "hdfs://nn:8020/user/x/runs"
    assert type(Store.create("dbfs:/ml/x")) is DBFSLocalStore
    assert Store.create("dbfs:/ml/x").prefix_path == "/dbfs/ml/x"
    assert type(Store.create("memory://bucket/x")) is FilesystemStore


@pytest.mark.parametrize("prefix", ["local", "memory://hvd-test-store"])
def test_store_atomic_writes(tmp_path: Path, prefix: str) -> None:
    pytest.importorskip("fsspec")
    from horovod.spark.common.store import METADATA_FILE, Store

    store = Store.create(str(tmp_path) if prefix == "local" else prefix)
    path = store.join(store.get_run_path("r"), "checkpoint")
    assert not store.exists(path)
    store.write_bytes(path, b"one")
    store.write_bytes(path, b"two")
    assert store.read_bytes(path) == b"two"
    data = store.get_train_data_path("k")
    store.makedirs(data)
    assert not store.is_complete(data)
    store.write_json(store.join(data, METADATA_FILE), {"a": 1})
    assert store.is_complete(data) and store.read_json(store.join(data, METADATA_FILE)) == {"a": 1}
    leftovers = [i.path for i in store.fs.get_file_info(
        __import__("pyarrow.fs").fs.FileSelector(store.fs_path(store.prefix_path), recursive=True))
        if ".tmp-" in i.path]
    assert leftovers == []


def _dataset(tmp_path: Path, groups: int = 10, rows: int = 50) -> tuple[list[str], dict[str, Any]]:
    files = []
    for g in range(groups):
        ids = np.arange(g * rows, (g + 1) * rows)
        x = pa.array([[float(i)] * 4 for i in ids], type=pa.list_(pa.float64()))
        table = pa.table({"id": pa.array(ids), "x": x})
        f = str(tmp_path / f"part-{g:03d}.parquet")
        pq.write_table(table, f, row_group_size=rows)
        files.append(f)
    meta = {"id": {"kind": "scalar", "shape": []}, "x": {"kind": "array", "shape": [4]}}
    return files, meta


def _take(reader: Any, rows: int) -> np.ndarray:
    out = []
    while sum(len(b) for b in out) < rows:
        out.append(next(reader)["id"])
    return np.concatenate(out)


@pytest.mark.parametrize("size", [2, 3])
def test_reader_shards_cover_every_row_once(tmp_path: Path, size: int) -> None:
    import pyarrow.fs as pafs

    from horovod.spark.common.reader import ParquetReader

    files, meta = _dataset(tmp_path)
    seen = []
    for rank in range(size):
        with ParquetReader(pafs.LocalFileSystem(), files, ["id", "x"], meta, batch_size=10,
                           rank=rank, size=size, seed=5) as r:
            ids = _take(iter(r), r.rows)
            assert len(ids) == r.rows
            batch = next(r)
            assert batch["x"].shape == (10, 4)
            np.testing.assert_array_equal(batch["x"][:, 0], batch["id"].astype(float))
            seen.append(ids)
    allids = np.concatenate(seen)
    assert sorted(allids.tolist()) == list(range(500))


def test_reader_shuffles_per_epoch_by_seed(tmp_path: Path) -> None:
    import pyarrow.fs as pafs

    from horovod.spark.common.reader import ParquetReader

    files, meta = _dataset(tmp_path)

    def epochs(seed: int | None, shuffle: bool = True) -> tuple[np.ndarray, np.ndarray]:
        with ParquetReader(pafs.LocalFileSystem(), files, ["id"], meta, batch_size=25,
                           seed=seed, shuffle=shuffle) as r:
            it = iter(r)
            return _take(it, 500), _take(it, 500)

    a1, a2 = epochs(1)
    b1, b2 = epochs(1)
    c1, _ = epochs(2)
    np.testing.assert_array_equal(a1, b1)
    np.testing.assert_array_equal(a2, b2)
    assert sorted(a1) == sorted(a2) == list(range(500))
    assert not np.array_equal(a1, a2) and not np.array_equal(a1, c1)
    plain, _ = epochs(None, shuffle=False)
    assert plain.tolist() == list(range(500))


def test_reader_memory_is_bounded_by_row_groups_not_dataset(tmp_path: Path) -> None:
    import pyarrow.fs as pafs

    from horovod.spark.common.reader import ParquetReader

    files, meta = _dataset(tmp_path, groups=40, rows=50)  # 2000 rows, 40 row groups
    with ParquetReader(pafs.LocalFileSystem(), files, ["id", "x"], meta, batch_size=32,
                       num_workers=2, queue_size=2) as r:
        _take(iter(r), 3 * 2000)  # three passes
        # decoded rows held at once: one row group plus the carried remainder of a batch
        assert r.peak_decoded_rows <= 50 + 32
        assert r._queue.maxsize == 2


def test_reader_transformation_fn_and_sparse(tmp_path: Path) -> None:
    import pyarrow.fs as pafs

    from horovod.spark.common.reader import ParquetReader

    files, meta = _dataset(tmp_path, groups=2)

    def double(df: Any) -> Any:
        df["id"] = df["id"] * 2
        return df

    with ParquetReader(pafs.LocalFileSystem(), files, ["id", "x"], meta, batch_size=100,
                       shuffle=False, transformation_fn=double) as r:
        batch = next(iter(r))
    assert batch["id"].tolist() == [2 * i for i in range(100)] and batch["x"].shape == (100, 4)

    idx = pa.array([[0, 3], [], [1]], type=pa.list_(pa.int32()))
    val = pa.array([[1.0, 2.0], [], [5.0]], type=pa.list_(pa.float64()))
    f = str(tmp_path / "sparse.parquet")
    pq.write_table(pa.table({"v__sparse_indices": idx, "v__sparse_values": val}), f)
    smeta = {"v": {"kind": "vector", "sparse": True, "shape": [4]}}
    with ParquetReader(pafs.LocalFileSystem(), [f], ["v"], smeta, batch_size=3,
                       shuffle=False) as r:
        dense = next(iter(r))["v"]
    np.testing.assert_array_equal(dense, [[1, 0, 0, 2], [0, 0, 0, 0], [0, 5, 0, 0]])


def test_reader_error_reaches_the_consumer(tmp_path: Path) -> None:
    import pyarrow.fs as pafs

    from horovod.spark.common.reader import ParquetReader

    files, meta = _dataset(tmp_path, groups=2)

    def broken(df: Any) -> Any:
        raise KeyError("no such field")

    with ParquetReader(pafs.LocalFileSystem(), files, ["id"], meta, batch_size=10,
                       transformation_fn=broken) as r:
        with pytest.raises(RuntimeError, match="rank 0.*no such field"):
            next(iter(r))


def test_estimator_params_follow_upstream() -> None:
    torch = pytest.importorskip("torch")
    from horovod.spark.torch import TorchEstimator

    est = TorchEstimator(num_proc=2, feature_cols=["f"], label_cols=["y"])
    assert (est.getBatchSize(), est.getEpochs(), est.getPartitionsPerProcess()) == (32, 1, 10)
    assert est.getShuffle() is True and est.getValidation() is None and est.getMetrics() == []
    assert (est.getTrainReaderNumWorkers(), est.getReaderPoolType()) == (2, "thread")
    est.setBatchSize(8).setEpochs(3)
    assert (est.getBatchSize(), est.getEpochs()) == (8, 3)
    assert est.getInputShapes() is None and est.getFeatureCols() == ["f"]
    with pytest.raises(TypeError, match="unknown parameter"):
        TorchEstimator(batchsize=3)
    with pytest.raises(ValueError, match="no optimizer"):
        TorchEstimator(model=torch.nn.Linear(2, 2), loss=lambda a, b: a)._check_model()


def test_keras_flavours_serialize(tmp_path: Path) -> None:
    pytest.importorskip("tensorflow")
    import keras
    tf_keras = pytest.importorskip("tf_keras")
    from horovod.spark.keras.util import keras_flavour, model_from_bytes, model_to_bytes

    for k, flavour in ((keras, "keras"), (tf_keras, "tf_keras")):
        m = k.Sequential([k.Input((3,)), k.layers.Dense(2)])
        assert keras_flavour(m) == flavour
        m2 = model_from_bytes(model_to_bytes(m), flavour)
        x = np.ones((1, 3), np.float32)
        np.testing.assert_allclose(m2.predict(x, verbose=0), m.predict(x, verbose=0), rtol=1e-6)


def test_keras_optimizer_state_round_trip() -> None:
    """What the Keras estimator's checkpoint keeps of the optimizer (step count, learning rate,
    Adam's moments) comes back into a fresh compiled model's optimizer, for both flavours: the
    next step then matches the uninterrupted one."""
    pytest.importorskip("tensorflow")
    import keras
    tf_keras = pytest.importorskip("tf_keras")
    from horovod.spark.keras.remote import optimizer_values, restore_optimizer

    x = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)
    for k in (keras, tf_keras):
        def compiled(k: Any = k) -> Any:
            m = k.Sequential([k.Input((3,)), k.layers.Dense(1)])
            m.compile(optimizer=k.optimizers.Adam(0.05), loss="mse")
            return m

        a = compiled()
        a.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
        saved, weights = optimizer_values(a.optimizer), a.get_weights()
        assert int(saved[0]) == 8, (k.__name__, saved[0])  # the step count: 2 epochs of 4 batches
        b = compiled()
        b.set_weights(weights)
        restore_optimizer(b.optimizer, b, saved)
        for s, r in zip(saved, optimizer_values(b.optimizer)):
            np.testing.assert_array_equal(s, r)
        a.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        b.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        for wa, wb in zip(a.get_weights(), b.get_weights()):
            np.testing.assert_allclose(wa, wb, rtol=1e-6, atol=1e-7)
        c = compiled()
        with pytest.raises(ValueError, match="optimizer variables"):
            restore_optimizer(c.optimizer, c, saved[:2])


def test_torch_sample_weights_weigh_each_rows_loss() -> None:
    """With sample weights a label's loss is upstream's: the mean of each row's loss times its
    weight, whether the loss is a function taking ``reduction``, a loss module or a function of
    the rows' losses; a loss that only gives the batch's mean is refused, not left unweighted."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from horovod.spark.torch.remote import _loss, _row_loss_of

    out, lab = torch.randn(6, 3), torch.tensor([0, 1, 2, 0, 1, 2])
    w = torch.tensor([1.0, 0.0, 2.0, 0.5, 1.0, 0.0])
    expected = (F.cross_entropy(out, lab, reduction="none") * w).mean()
    module = torch.nn.CrossEntropyLoss()
    for fn in (F.cross_entropy, module, lambda o, t: F.cross_entropy(o, t, reduction="none")):
        assert torch.equal(_loss([fn], None, [out], [lab], w), expected)
    assert module.reduction == "mean"  # the estimator's copy ran with reduction="none"
    # worked out once per loss, not per batch: later batches reuse the same callable
    assert _row_loss_of(module) is _row_loss_of(module)
    assert _row_loss_of(F.cross_entropy) is _row_loss_of(F.cross_entropy)
    assert torch.equal(_loss([module], None, [out], [lab], w), expected)
    assert torch.equal(_loss([F.cross_entropy], [0.5], [out], [lab], None), 0.5 * F.cross_entropy(out, lab))
    with pytest.raises(ValueError, match=r"loss <lambda> of label column 0 gave a value of shape \(\)"):
        _loss([lambda o, t: F.cross_entropy(o, t)], None, [out], [lab], w)


def test_upstream_names_import() -> None:
    """The public names of upstream's horovod.spark.{common,keras,torch,lightning} modules that
    user code imports (upstream's examples and tests)."""
    from horovod.spark.common import backend, constants, store, util
    from horovod.spark.keras import estimator as keras_est
    from horovod.spark.keras import remote as keras_remote
    from horovod.spark.keras import util as keras_util
    from horovod.spark.lightning import estimator as pl_est
    from horovod.spark.lightning import remote as pl_remote
    from horovod.spark.lightning import util as pl_util
    from horovod.spark.torch import estimator as torch_est
    from horovod.spark.torch import remote as torch_remote
    from horovod.spark.torch import util as torch_util

    expected = {
        backend: ["Backend", "SparkBackend", "default_num_proc"],
        store: ["Store", "AbstractFilesystemStore", "FilesystemStore", "LocalStore", "HDFSStore",
                "DBFSLocalStore"],
        constants: ["PETASTORM_HDFS_DRIVER", "METRIC_PRINT_FREQUENCY", "ARRAY", "CUSTOM_SPARSE", "NOCHANGE",
                    "MIXED_SPARSE_DENSE_VECTOR", "SPARSE_VECTOR", "DENSE_VECTOR",
                    "TOTAL_BUFFER_MEMORY_CAP_GIB", "BYTES_PER_GIB"],
        util: ["prepare_data", "get_dataset_properties", "host_hash", "data_type_to_str",
               "numpy_type_to_str", "spark_scalar_to_python_type", "pyarrow_to_spark_data_type",
               "data_type_to_numpy", "check_shape_compatibility", "check_validation",
               "clear_training_cache", "to_list", "is_databricks", "get_output_cols",
               "get_spark_df_output_schema", "get_simple_meta_from_parquet", "to_petastorm_fn"],
        keras_est: ["KerasEstimator", "KerasModel", "EstimatorParams", "KerasEstimatorParamsWriter",
                    "KerasEstimatorParamsReader", "KerasEstimatorParamsWritable",
                    "KerasEstimatorParamsReadable"],
        keras_util: ["TF_KERAS"],
        keras_remote: ["BYTES_PER_GIB", "TOTAL_BUFFER_MEMORY_CAP_GIB"],
        torch_est: ["TorchEstimator", "TorchModel", "EstimatorParams", "TorchEstimatorParamsWriter",
                    "TorchEstimatorParamsReader", "TorchEstimatorParamsWritable",
                    "TorchEstimatorParamsReadable"],
        torch_remote: ["PETASTORM_HDFS_DRIVER", "METRIC_PRINT_FREQUENCY", "TOTAL_BUFFER_MEMORY_CAP_GIB",
                       "BYTES_PER_GIB", "CUSTOM_SPARSE"],
        pl_est: ["TorchEstimator", "TorchModel", "MIN_PL_VERSION", "EstimatorParams",
                 "TorchEstimatorParamsWriter", "TorchEstimatorParamsReader",
                 "TorchEstimatorParamsWritable", "TorchEstimatorParamsReadable"],
        pl_remote: ["METRIC_PRINT_FREQUENCY", "TOTAL_BUFFER_MEMORY_CAP_GIB", "BYTES_PER_GIB", "CUSTOM_SPARSE"],
    }
    for utils in (torch_util, pl_util):
        expected[utils] = ["is_module_available", "is_module_available_fn", "serialize_fn", "deserialize_fn",
                           "save_into_bio", "save_into_bio_fn"]
    missing = {m.__name__: [n for n in names if not hasattr(m, n)] for m, names in expected.items()}
    assert not any(missing.values()), missing
    import lightning
    from packaging.version import Version
    assert Version(lightning.__version__) >= Version(pl_est.MIN_PL_VERSION)
    assert util.to_list(3, 2) == [3, 3] and util.to_list([1, 2], 2) == [1, 2] and util.to_list(None, 2) is None
    with pytest.raises(ValueError, match="must be length 3"):
        util.to_list([1, 2], 3)
    util.check_validation(0.2)
    with pytest.raises(ValueError, match="range"):
        util.check_validation(1.5)
    with pytest.raises(ValueError, match="float.*str"):
        util.check_validation(3)
    meta = {"f": {"shape": [64]}, "y": {"shape": []}}
    util.check_shape_compatibility(meta, ["f"], ["y"], input_shapes=[[-1, 8, 8]], output_shapes=[[-1]])
    with pytest.raises(ValueError, match="Feature column 'f' with size 64"):
        util.check_shape_compatibility(meta, ["f"], ["y"], input_shapes=[[-1, 7, 8]])
    assert util.host_hash() == util.host_hash() != util.host_hash(salt="x")
    ser = torch_util.serialize_fn()({"a": [1, 2]})
    assert isinstance(ser, str) and torch_util.deserialize_fn()(ser) == {"a": [1, 2]}
    assert torch_util.is_module_available("numpy") and not torch_util.is_module_available("no_such_mod_xyz")
    assert torch_util.save_into_bio(b"xyz", lambda o, f: f.write(o)).read() == b"xyz"
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql.types import DoubleType, LongType, StructField, StructType

    assert util.data_type_to_str(VectorUDT) == "Vector" and util.data_type_to_str(DoubleType()) == "Double"
    assert util.data_type_to_numpy(LongType) is np.int64 and util.numpy_type_to_str(np.float32) == "Float"
    schema = StructType([StructField("x", DoubleType())])
    out = util.get_spark_df_output_schema(schema, ["y"], ["y_pred"], {"y": {"spark_data_type": "Vector"}})
    assert [f.name for f in out.fields] == ["x", "y_pred"] and isinstance(out.fields[1].dataType, VectorUDT)
    assert util.get_output_cols(schema, ["p"]) == ["x", "p"]


def test_a_ranks_training_function_loads_without_pyspark(tmp_path: Path) -> None:
    """Every rank of a fit unpickles the estimator's training function in a fresh interpreter:
    the function, its spec and the frameworks' ``remote`` modules load without PySpark (and the
    pandas it brings), which the ranks never use and which cost each rank most of a second."""
    import os
    import subprocess
    import sys

    import cloudpickle
    import torch

    from horovod.spark.common.store import Store
    from horovod.spark.common.training import TrainingSpec
    from horovod.spark.torch import TorchEstimator

    net = torch.nn.Linear(4, 2)
    est = TorchEstimator(num_proc=2, store=Store.create(str(tmp_path / "store")), model=net,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                         loss=torch.nn.functional.cross_entropy, feature_cols=["f"], label_cols=["l"])
    fn = est._train_fn(TrainingSpec(store=est.getStore()))
    (tmp_path / "train.pkl").write_bytes(cloudpickle.dumps(fn))
    code = ("import sys, cloudpickle\n"
            f"fn = cloudpickle.loads(open({str(tmp_path / 'train.pkl')!r}, 'rb').read())\n"
            "assert callable(fn)\n"
            "import horovod.spark.keras.remote, horovod.spark.lightning.remote\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pyspark', 'pandas')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout[-2000:]
