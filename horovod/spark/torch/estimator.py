"""``TorchEstimator`` and ``TorchModel`` (upstream's names and parameters)."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

from horovod.spark.common.estimator import HorovodEstimator, HorovodModel, TrainingSpec
from horovod.spark.common.params import EstimatorParams, declare_params
from horovod.spark.common.persistence import HorovodReadable, HorovodReader, HorovodWritable, HorovodWriter
from horovod.spark.torch.util import ModuleParams, _module_bytes, _module_from_bytes, _to_tensor, check_input_shapes

__all__ = ["TorchEstimator", "TorchModel", "TorchEstimatorParamsWriter",
           "TorchEstimatorParamsReader", "TorchEstimatorParamsWritable",
           "TorchEstimatorParamsReadable", "EstimatorParams"]


class TorchEstimator(ModuleParams, HorovodEstimator):
    """Trains a ``torch.nn.Module`` with Horovod on the rows of a DataFrame.

    ``optimizer`` is an optimizer built on ``model.parameters()`` (its class and defaults are used
    on every rank); ``loss`` a function ``loss(outputs, labels)`` (or one per output, weighted by
    ``loss_weights``), or ``loss_constructors`` functions returning them; ``input_shapes`` the
    shape each feature column is reshaped to (``-1`` for the batch), default ``[-1, n]``."""

    def _check_model(self) -> None:
        import torch

        super()._check_model()
        if not isinstance(self.getModel(), torch.nn.Module):
            raise TypeError(f"TorchEstimator: model must be a torch.nn.Module, got "
                            f"{type(self.getModel()).__name__}.")
        if self.getOptimizer() is None:
            raise ValueError("TorchEstimator: no optimizer given (optimizer=torch.optim.X(model."
                             "parameters(), ...)).")
        if self.getLoss() is None and not self.getLossConstructors():
            raise ValueError("TorchEstimator: no loss given (loss=torch.nn.functional.X, or "
                             "loss_constructors=[...]).")

    def _check_shapes(self, metadata: dict[str, Any]) -> None:
        check_input_shapes(metadata, list(self.getFeatureCols()), self.getInputShapes())

    def _train_fn(self, spec: TrainingSpec) -> Callable[[], Any]:
        from horovod.spark.torch.remote import make_train_fn

        opt = self.getOptimizer()
        spec.update(model_bytes=_module_bytes(self.getModel()),
                    optimizer_cls=type(opt), optimizer_defaults=dict(opt.defaults),
                    loss=self.getLoss(), loss_weights=self.getLossWeights(),
                    loss_constructors=self.getLossConstructors(), metrics=self.getMetrics(),
                    input_shapes=self.getInputShapes(), use_gpu=self.getUseGpu(),
                    train_minibatch_fn=self.getTrainMinibatchFn(),
                    callbacks=self.getCallbacks())
        return make_train_fn(spec)

    def _make_model(self, result: dict[str, Any], spec: TrainingSpec) -> TorchModel:
        return trained_model(TorchModel, self, result, spec)

    @classmethod
    def _params_to_bytes(cls, values: dict[str, Any]) -> dict[str, Any]:
        out = super()._params_to_bytes(values)
        opt = out.get("optimizer")
        if opt is not None:  # an optimizer refers to the model's tensors: keep its recipe
            out["optimizer"] = ("__optimizer__", type(opt), dict(opt.defaults))
        return out

    @classmethod
    def _params_from_bytes(cls, values: dict[str, Any]) -> dict[str, Any]:
        out = super()._params_from_bytes(values)
        opt = out.get("optimizer")
        if isinstance(opt, tuple) and opt and opt[0] == "__optimizer__" and out.get("model") is not None:
            out["optimizer"] = opt[1](out["model"].parameters(), **opt[2])
        return out


declare_params(TorchEstimator, [
    ("input_shapes", None, "shape of each feature column's tensor, -1 for the batch"),
    ("loss_constructors", None, "functions returning the loss function(s)"),
    ("train_minibatch_fn", None, "a function returning train_minibatch(model, optimizer, "
                                 "transform_outputs, loss_fn, inputs, labels, sample_weights)"),
])


class TorchModel(ModuleParams, HorovodModel):
    """A trained ``torch.nn.Module``; ``transform(df)`` adds its predictions (a double for a
    single value per row, else a dense vector)."""

    def _predict_factory(self) -> Callable[[], Callable[[list[Any]], list[Any]]]:
        blob = _module_bytes(self.getModel())
        shapes = self.getInputShapes()

        def factory() -> Callable[[list[Any]], list[Any]]:
            import torch

            torch.set_num_threads(1)
            model = _module_from_bytes(blob)
            model.eval()

            def predict(features: list[Any]) -> list[Any]:
                inputs = [_to_tensor(f, shapes[i] if shapes else None)
                          for i, f in enumerate(features)]
                with torch.no_grad():
                    out = model(*inputs)
                outs = list(out) if isinstance(out, (list, tuple)) else [out]
                return [o.detach().cpu().double().numpy().reshape(len(features[0]), -1) for o in outs]
            return predict
        return factory


declare_params(TorchModel, [("input_shapes", None, "shape of each feature column's tensor")])


def trained_model(model_cls: type[TorchModel], estimator: Any, result: dict[str, Any],
                  spec: TrainingSpec) -> Any:
    """``model_cls`` around a copy of the estimator's module with the trained weights of ``result``
    (the torch and the Lightning estimators)."""
    import torch

    model = copy.deepcopy(estimator.getModel())
    model.load_state_dict(torch.load(io.BytesIO(result["state"]), weights_only=True))
    model.eval()
    return model_cls(history=result["history"], model=model, feature_columns=spec["feature_cols"],
                     label_columns=spec["label_cols"], input_shapes=estimator.getInputShapes(),
                     run_id=spec["run_id"], _metadata=spec["metadata"])


# Upstream's names for the persistence classes and the params (imported by user code and tests).
TorchEstimatorParamsWriter = HorovodWriter
TorchEstimatorParamsReader = HorovodReader
TorchEstimatorParamsWritable = HorovodWritable
TorchEstimatorParamsReadable = HorovodReadable
