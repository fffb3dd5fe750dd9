"""Upstream's ``EstimatorParams`` and ``ModelParams``: Spark ML ``Params`` with a ``setX``/``getX``
pair for every parameter, settable through the constructor's keyword arguments."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pyspark.ml.param import Param, Params

__all__ = ["EstimatorParams", "ModelParams", "declare_params", "camel"]


def camel(name: str) -> str:
    return "".join(p[:1].upper() + p[1:] for p in name.split("_"))


def declare_params(cls: type, specs: list[tuple[str, Any, str]]) -> type:
    """Give ``cls`` a ``Param`` attribute, a default, and ``set<Name>``/``get<Name>`` methods for
    each ``(name, default, doc)`` in ``specs``."""
    defaults = dict(getattr(cls, "_param_defaults", {}))
    for name, default, doc in specs:
        setattr(cls, name, Param(Params._dummy(), name, doc))
        defaults[name] = default

        def setter(self: Any, value: Any, _n: str = name) -> Any:
            return self._set(**{_n: value})

        def getter(self: Any, _n: str = name) -> Any:
            return self.getOrDefault(getattr(self, _n))

        setter.__name__, getter.__name__ = f"set{camel(name)}", f"get{camel(name)}"
        setter.__doc__ = getter.__doc__ = doc
        if f"set{camel(name)}" not in cls.__dict__:
            setattr(cls, f"set{camel(name)}", setter)
        if f"get{camel(name)}" not in cls.__dict__:
            setattr(cls, f"get{camel(name)}", getter)
    cls._param_defaults = defaults  # type: ignore[attr-defined]
    return cls


class _KwargParams(Params):
    """Params set from constructor keyword arguments; an unknown one is a ``TypeError``."""

    _param_defaults: dict[str, Any] = {}

    if TYPE_CHECKING:
        # The get<Name>/set<Name> methods that declare_params adds to the class at import.
        def __getattr__(self, name: str) -> Any: ...

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._setDefault(**{k: v for k, v in self._param_defaults.items() if self.hasParam(k)})
        unknown = [k for k in kwargs if not self.hasParam(k)]
        if unknown:
            raise TypeError(f"{type(self).__name__} got unknown parameter(s) {unknown}; known: "
                            f"{sorted(p.name for p in self.params)}")
        self._set(**kwargs)

    def _set(self, **kwargs: Any) -> Any:
        for k, v in kwargs.items():
            self._paramMap[self.getParam(k)] = v
        return self

    @classmethod
    def _params_to_bytes(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Parameter values in a picklable form (framework classes serialize their models)."""
        return values

    @classmethod
    def _params_from_bytes(cls, values: dict[str, Any]) -> dict[str, Any]:
        return values

    def param_values(self) -> dict[str, Any]:
        """Every parameter's current value (set or default), by name."""
        return {p.name: self.getOrDefault(p) for p in self.params if self.isDefined(p)}


ESTIMATOR_PARAMS: list[tuple[str, Any, str]] = [
    ("num_proc", None, "number of Horovod processes (Spark tasks); exclusive with backend"),
    ("model", None, "the model to train"),
    ("backend", None, "a Backend that runs the training (default SparkBackend(num_proc))"),
    ("store", None, "the Store holding prepared data, checkpoints and logs"),
    ("optimizer", None, "the optimizer"),
    ("loss", None, "loss function(s)"),
    ("loss_weights", None, "weights of the losses of several outputs"),
    ("sample_weight_col", None, "column of per-row sample weights"),
    ("metrics", [], "metrics computed during training"),
    ("feature_cols", None, "feature column names"),
    ("label_cols", None, "label column names"),
    ("continuous_cols", None, "continuous feature columns (tabular models)"),
    ("categorical_cols", None, "categorical feature columns (tabular models)"),
    ("validation", None, "a 0/1 column name marking validation rows, or a fraction in [0, 1)"),
    ("callbacks", [], "training callbacks"),
    ("gradient_compression", None, "Horovod gradient compression (hvd.Compression.*)"),
    ("compress_sparse_cols", False, "keep sparse vectors sparse in the prepared data"),
    ("batch_size", 32, "training batch size per process"),
    ("val_batch_size", None, "validation batch size per process (default batch_size)"),
    ("epochs", 1, "number of epochs"),
    ("verbose", 1, "verbosity"),
    ("random_seed", None, "seed of the per-epoch shuffle and of the model's initialization"),
    ("shuffle_buffer_size", None, "deprecated: the reader shuffles row groups and rows"),
    ("shuffle", True, "shuffle the training rows every epoch"),
    ("partitions_per_process", 10, "Parquet files (row groups) written per process"),
    ("run_id", None, "the run's id in the store; an existing checkpoint under it is resumed"),
    ("train_steps_per_epoch", None, "training steps per epoch (default rows / batch / processes)"),
    ("validation_steps_per_epoch", None, "validation steps per epoch (default: all rows once)"),
    ("transformation_fn", None, "function applied to each decoded pandas chunk of rows"),
    ("transformation_edit_fields", None, "fields transformation_fn adds or changes"),
    ("transformation_removed_fields", None, "fields transformation_fn removes"),
    ("train_reader_num_workers", 2, "decode threads of the training reader"),
    ("val_reader_num_workers", 2, "decode threads of the validation reader"),
    ("reader_pool_type", "thread", "thread|process|dummy (the reader uses threads)"),
    ("label_shapes", None, "shapes of the labels"),
    ("inmemory_cache_all", False, "keep the rank's decoded rows in memory after the first epoch"),
    ("use_gpu", True, "train on a GPU when the Spark task has one"),
    ("mp_start_method", None, "multiprocessing start method (unused: the reader uses threads)"),
    ("backward_passes_per_step", 1, "local gradient accumulation steps per allreduce"),
    ("tensorflow_dataset_prefetch_buffer_size", 0, "batches prefetched (Keras)"),
    ("data_module", None, "the DataModule class that reads the prepared data (default "
                          "ParquetDataModule)"),
]


class EstimatorParams(_KwargParams):
    pass


declare_params(EstimatorParams, ESTIMATOR_PARAMS)

MODEL_PARAMS: list[tuple[str, Any, str]] = [
    ("history", None, "per-epoch metrics of the training"),
    ("model", None, "the trained model"),
    ("feature_columns", None, "feature column names"),
    ("label_columns", None, "label column names"),
    ("output_cols", None, "prediction column names (default <label>__output)"),
    ("run_id", None, "the training run's id"),
    ("_metadata", None, "shapes and types of the columns"),
]


class ModelParams(_KwargParams):
    def getOutputCols(self) -> list[str]:  # noqa: N802 - Spark ML naming
        cols = self.getOrDefault(self.getParam("output_cols"))
        if cols:
            return list(cols)
        return [f"{c}__output" for c in self.getOrDefault(self.getParam("label_columns"))]


declare_params(ModelParams, MODEL_PARAMS)
