"""``HorovodEstimator`` and ``HorovodModel``: the framework-neutral half of the estimators.

``fit(df)`` checks the columns, prepares the data in the store (``util.prepare_data``), runs the
framework's training function on every rank through the backend (``horovod.spark.run``) and
wraps rank 0's trained model in the framework's ``HorovodModel``. ``transform(df)`` runs the model
as a batched pandas UDF on the executors. Both are Spark ML ``MLWritable``/``MLReadable``.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from typing import Any

from pyspark.ml import Estimator, Model
from pyspark.ml.util import MLReadable, MLWritable

from horovod.spark.common import util
from horovod.spark.common.backend import Backend, SparkBackend
from horovod.spark.common.params import EstimatorParams, ModelParams
from horovod.spark.common.persistence import HorovodReader, HorovodWriter
from horovod.spark.common.store import AbstractFilesystemStore
from horovod.spark.common.training import TrainingSpec, data_module_for  # noqa: F401 - their old home

__all__ = ["HorovodEstimator", "HorovodModel", "TrainingSpec"]


class HorovodEstimator(Estimator, EstimatorParams, MLWritable, MLReadable):
    """Base of ``KerasEstimator`` and the Torch estimators."""

    def __init__(self, **kwargs: Any) -> None:
        Estimator.__init__(self)
        EstimatorParams.__init__(self, **kwargs)

    # -- hooks of the framework estimators -----------------------------------------------------
    def _check_model(self) -> None:
        if self.getModel() is None:
            raise ValueError(f"{type(self).__name__}: no model given (model=...).")

    def _train_fn(self, spec: TrainingSpec) -> Callable[[], Any]:
        raise NotImplementedError

    def _make_model(self, result: dict[str, Any], spec: TrainingSpec) -> HorovodModel:
        raise NotImplementedError

    def _check_shapes(self, metadata: dict[str, Any]) -> None:
        """Framework checks of the columns' shapes against the model (before training)."""

    def _backend_env(self) -> dict[str, str]:
        """Environment variables the training processes need (beyond the backend's own)."""
        return {}

    # -- Spark ML persistence ------------------------------------------------------------------
    def write(self) -> HorovodWriter:
        return HorovodWriter(self)

    @classmethod
    def read(cls) -> HorovodReader:
        return HorovodReader(cls)

    # -- fit -----------------------------------------------------------------------------------
    def _backend(self) -> Backend:
        backend, num_proc = self.getBackend(), self.getNumProc()
        if backend is not None and num_proc is not None:
            raise ValueError("Give the estimator num_proc or backend, not both (upstream's rule): "
                             f"num_proc={num_proc}, backend={backend!r}.")
        return backend if backend is not None else SparkBackend(num_proc=num_proc)

    def _store(self) -> AbstractFilesystemStore:
        store = self.getStore()
        if store is None:
            raise ValueError(f"{type(self).__name__}: no store given: pass store=Store.create(path) "
                             "(a directory every Spark executor can read and write).")
        return store

    def _columns(self) -> tuple[list[str], list[str]]:
        feats, labels = self.getFeatureCols(), self.getLabelCols()
        if not feats or not labels:
            raise ValueError(f"{type(self).__name__}: give feature_cols and label_cols "
                             f"(got feature_cols={feats!r}, label_cols={labels!r}).")
        return list(feats), list(labels)

    def _fit(self, df: Any) -> HorovodModel:
        self._check_model()
        feats, labels = self._columns()
        backend, store = self._backend(), self._store()
        idx = util.prepare_data(backend.num_processes(), store, df, label_columns=labels,
                                feature_columns=feats, validation=self.getValidation(),
                                sample_weight_col=self.getSampleWeightCol(),
                                compress_sparse=self.getCompressSparseCols(),
                                partitions_per_process=self.getPartitionsPerProcess(),
                                verbose=self.getVerbose())
        return self._fit_on_prepared_data(backend, store, idx)

    def fit_on_parquet(self, params: dict[Any, Any] | None = None,
                       dataset_idx: Any = None) -> HorovodModel:
        """Train on Parquet already in the store (``store.get_train_data_path(dataset_idx)``,
        and the validation path beside it when it exists)."""
        est = self.copy(params) if params else self
        est._check_model()
        return est._fit_on_prepared_data(est._backend(), est._store(), dataset_idx)

    def _fit_on_prepared_data(self, backend: Backend, store: AbstractFilesystemStore,
                              idx: Any) -> HorovodModel:
        feats, labels = self._columns()
        info = util.read_data_metadata(store, idx)
        meta = info["metadata"]
        weight = self.getSampleWeightCol()
        needed = feats + labels + ([weight] if weight else [])
        missing = [c for c in needed if c not in meta]
        if missing:
            raise util.DataPreparationError(
                f"Column(s) {missing} are not in the prepared data at "
                f"{store.get_train_data_path(idx)} (it has {sorted(meta)}).")
        self._check_shapes(meta)
        size = backend.num_processes()
        batch, val_batch = self.getBatchSize(), self.getValBatchSize() or self.getBatchSize()
        train_steps = self.getTrainStepsPerEpoch() or max(1, info["train_rows"] // (batch * size))
        val_rows = info["val_rows"]
        val_steps = 0
        if val_rows:
            val_steps = self.getValidationStepsPerEpoch() or max(
                1, math.ceil(val_rows / (val_batch * size)))
        run_id = self.getRunId() or f"{type(self).__name__.lower()}_{uuid.uuid4().hex[:12]}"
        spec = TrainingSpec(
            store=store, train_path=store.get_train_data_path(idx),
            val_path=store.get_val_data_path(idx) if val_rows else None, metadata=meta,
            feature_cols=feats, label_cols=labels, sample_weight_col=weight,
            batch_size=batch, val_batch_size=val_batch, train_steps=train_steps,
            val_steps=val_steps, epochs=self.getEpochs(), run_id=run_id,
            checkpoint_path=store.get_checkpoint_path(run_id), shuffle=self.getShuffle(),
            random_seed=self.getRandomSeed(), verbose=self.getVerbose(),
            transformation_fn=self.getTransformationFn(),
            train_reader_num_workers=self.getTrainReaderNumWorkers(),
            val_reader_num_workers=self.getValReaderNumWorkers(),
            inmemory_cache_all=self.getInmemoryCacheAll(), data_module=self.getDataModule(),
            gradient_compression=self.getGradientCompression(),
            backward_passes_per_step=self.getBackwardPassesPerStep())
        results = backend.run(self._train_fn(spec),
                              env={**self._backend_env(), "HOROVOD_SPARK_RUN_ID": run_id})
        result = next(r for r in results if r)
        return self._make_model(result, spec)


class HorovodModel(Model, ModelParams, MLWritable, MLReadable):
    """A trained model as a Spark ML ``Model``: ``transform(df)`` adds the prediction columns."""

    def __init__(self, **kwargs: Any) -> None:
        Model.__init__(self)
        ModelParams.__init__(self, **kwargs)

    def setOutputCols(self, value: list[str]) -> HorovodModel:  # noqa: N802 - Spark ML naming
        return self._set(output_cols=list(value))

    def write(self) -> HorovodWriter:
        return HorovodWriter(self)

    @classmethod
    def read(cls) -> HorovodReader:
        return HorovodReader(cls)

    def _predict_factory(self) -> Callable[[], Callable[[list[Any]], list[Any]]]:
        """A picklable function that builds, on an executor, ``predict(features) -> outputs``."""
        raise NotImplementedError

    def _transform(self, df: Any) -> Any:
        import numpy as np
        from pyspark.ml.functions import array_to_vector, vector_to_array
        from pyspark.sql import functions as F
        from pyspark.sql.types import ArrayType, DoubleType, StructField, StructType

        feats = list(self.getFeatureColumns())
        meta = self.getOrDefault(self.getParam("_metadata")) or {}
        util.check_columns(df, feats, {c: "feature" for c in feats})
        factory = self._predict_factory()
        probe = factory()([np.zeros([1, *meta[c]["shape"]], dtype=meta[c]["dtype"])
                           for c in feats])
        outs = self.getOutputCols()
        if len(probe) != len(outs):
            raise ValueError(f"The model returns {len(probe)} output(s) but output_cols has "
                             f"{len(outs)}: {outs}. Give one output column per model output.")
        sizes = [int(np.asarray(p).size) for p in probe]
        fields = [StructField(o, DoubleType() if s == 1 else ArrayType(DoubleType()))
                  for o, s in zip(outs, sizes)]
        from horovod.spark.common._predict import make_udf

        udf = make_udf(factory, list(zip(outs, sizes)), StructType(fields))
        args = [vector_to_array(F.col(c)) if meta[c]["kind"] == "vector" else F.col(c)
                for c in feats]
        tmp = f"__hvd_pred_{uuid.uuid4().hex[:6]}"
        out = df.withColumn(tmp, udf(*args))
        for o, s in zip(outs, sizes):
            col = F.col(f"{tmp}.{o}")
            out = out.withColumn(o, col if s == 1 else array_to_vector(col))
        return out.drop(tmp)
