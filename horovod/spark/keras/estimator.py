"""``KerasEstimator`` and ``KerasModel`` (upstream's names and parameters).

Models of Keras 3 (``import keras``) and of Keras 2 (``import tf_keras``) both work: the flavour
is read from the model's class, and the ranks import ``horovod.tensorflow.keras`` with
``TF_USE_LEGACY_KERAS=1`` for a ``tf_keras`` model.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from horovod.spark.common.estimator import HorovodEstimator, HorovodModel, TrainingSpec
from horovod.spark.common.params import EstimatorParams, declare_params
from horovod.spark.common.persistence import HorovodReadable, HorovodReader, HorovodWritable, HorovodWriter
from horovod.spark.common.util import check_feature_shapes
from horovod.spark.keras.util import (
    _shaped,
    input_shapes_of,
    keras_flavour,
    keras_module,
    model_from_bytes,
    model_to_bytes,
)

__all__ = ["KerasEstimator", "KerasModel", "KerasEstimatorParamsWriter",
           "KerasEstimatorParamsReader", "KerasEstimatorParamsWritable",
           "KerasEstimatorParamsReadable", "EstimatorParams"]


class _KerasModelParams:
    """Estimator or model params whose ``model`` is a Keras model: saved as its flavour and
    bytes (``model_to_bytes``), loaded with the ``custom_objects`` param; a ``Backend`` is never
    saved."""

    @classmethod
    def _params_to_bytes(cls, values: dict[str, Any]) -> dict[str, Any]:
        out = dict(values)
        model = out.get("model")
        if model is not None:
            out["model"] = ("__keras__", keras_flavour(model), model_to_bytes(model))
        out.pop("backend", None)
        return out

    @classmethod
    def _params_from_bytes(cls, values: dict[str, Any]) -> dict[str, Any]:
        out = dict(values)
        m = out.get("model")
        if isinstance(m, tuple) and m and m[0] == "__keras__":
            out["model"] = model_from_bytes(m[2], m[1], out.get("custom_objects"))
        return out


class KerasEstimator(_KerasModelParams, HorovodEstimator):
    """Trains a compiled-on-each-rank Keras model with Horovod on the rows of a DataFrame.

    ``optimizer`` a Keras optimizer (wrapped in ``hvd.DistributedOptimizer`` on every rank),
    ``loss`` / ``metrics`` / ``loss_weights`` as ``model.compile`` takes them, ``custom_objects``
    for loading custom layers, ``checkpoint_callback`` a Keras callback run on rank 0."""

    def _check_model(self) -> None:
        super()._check_model()
        if not hasattr(self.getModel(), "fit"):
            raise TypeError(f"KerasEstimator: model must be a Keras model, got "
                            f"{type(self.getModel()).__name__}.")
        if self.getOptimizer() is None or self.getLoss() is None:
            raise ValueError("KerasEstimator: give optimizer= and loss= (as model.compile takes).")
        boards = [c for c in self.getCallbacks() or [] if type(c).__name__ == "TensorBoard"]
        if boards:
            import importlib.util

            if importlib.util.find_spec("tensorboard") is None:
                raise ValueError("KerasEstimator: callbacks holds a TensorBoard callback, but the "
                                 "tensorboard package is not installed (its summaries need it): "
                                 "pip install tensorboard, or drop the callback.")

    def _check_shapes(self, metadata: dict[str, Any]) -> None:
        shapes = input_shapes_of(self.getModel())
        if shapes is not None:  # each without its batch dimension
            check_feature_shapes(metadata, list(self.getFeatureCols()), [list(s[1:]) for s in shapes],
                                 "the model's input")

    def _train_fn(self, spec: TrainingSpec) -> Callable[[], Any]:
        from horovod.spark.keras.remote import make_train_fn

        model = self.getModel()
        flavour = keras_flavour(model)
        k = keras_module(flavour)
        spec.update(flavour=flavour, model_bytes=model_to_bytes(model),
                    optimizer_config=k.optimizers.serialize(self.getOptimizer()),
                    loss=self.getLoss(), loss_weights=self.getLossWeights(),
                    metrics=self.getMetrics(), custom_objects=self.getCustomObjects(),
                    callbacks=self.getCallbacks(), checkpoint_callback=self.getCheckpointCallback(),
                    input_shapes=input_shapes_of(model),
                    prefetch=self.getTensorflowDatasetPrefetchBufferSize())
        return make_train_fn(spec)

    def _backend_env(self) -> dict[str, str]:
        env = {k: str(v) for k, v in (self.getBackendEnv() or {}).items()}
        if keras_flavour(self.getModel()) == "tf_keras":
            env.setdefault("TF_USE_LEGACY_KERAS", "1")
        return env

    def _make_model(self, result: dict[str, Any], spec: TrainingSpec) -> KerasModel:
        model = model_from_bytes(spec["model_bytes"], spec["flavour"], spec["custom_objects"])
        model.set_weights(result["weights"])
        return KerasModel(history=result["history"], model=model,
                          feature_columns=spec["feature_cols"], label_columns=spec["label_cols"],
                          custom_objects=spec["custom_objects"], run_id=spec["run_id"],
                          _metadata=spec["metadata"], _floatx="float32")

    @classmethod
    def _params_to_bytes(cls, values: dict[str, Any]) -> dict[str, Any]:
        out = super()._params_to_bytes(values)
        model = out.get("model")
        if model is not None and out.get("optimizer") is not None:
            flavour = model[1]
            out["optimizer"] = ("__keras_opt__", flavour,
                                keras_module(flavour).optimizers.serialize(out["optimizer"]))
        return out

    @classmethod
    def _params_from_bytes(cls, values: dict[str, Any]) -> dict[str, Any]:
        out = super()._params_from_bytes(values)
        o = out.get("optimizer")
        if isinstance(o, tuple) and o and o[0] == "__keras_opt__":
            out["optimizer"] = keras_module(o[1]).optimizers.deserialize(o[2])
        return out


declare_params(KerasEstimator, [
    ("custom_objects", {}, "custom objects for loading the model"),
    ("checkpoint_callback", None, "a Keras callback run on rank 0 (e.g. ModelCheckpoint)"),
    ("backend_env", {}, "environment variables of the training processes"),
])


class KerasModel(_KerasModelParams, HorovodModel):
    """A trained Keras model; ``transform(df)`` adds its predictions (a double for a single value
    per row, else a dense vector)."""

    def _predict_factory(self) -> Callable[[], Callable[[list[Any]], list[Any]]]:
        model = self.getModel()
        flavour = keras_flavour(model)
        blob = model_to_bytes(model)
        custom = self.getCustomObjects()
        shapes = input_shapes_of(model)

        def factory() -> Callable[[list[Any]], list[Any]]:
            os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
            net = model_from_bytes(blob, flavour, custom)

            def predict(features: list[Any]) -> list[Any]:
                xs = [_shaped(f, shapes[i] if shapes else None) for i, f in enumerate(features)]
                out = net(xs[0] if len(xs) == 1 else xs, training=False)
                outs = list(out) if isinstance(out, (list, tuple)) else [out]
                return [np.asarray(o).reshape(len(features[0]), -1) for o in outs]
            return predict
        return factory


declare_params(KerasModel, [("custom_objects", {}, "custom objects for loading the model"),
                            ("_floatx", "float32", "Keras floatx of the trained model")])


# Upstream's names for the persistence classes and the params (imported by user code and tests).
KerasEstimatorParamsWriter = HorovodWriter
KerasEstimatorParamsReader = HorovodReader
KerasEstimatorParamsWritable = HorovodWritable
KerasEstimatorParamsReadable = HorovodReadable
