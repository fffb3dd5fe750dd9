"""The Lightning ``TorchEstimator`` and its ``TorchModel`` (upstream's names and parameters).

The model is a ``LightningModule`` whose ``training_step``/``validation_step`` receive a batch as
a dict ``{column name: tensor}`` (floating columns as float32), as upstream's. Its
``configure_optimizers`` gives the optimizer; ``loss``/``optimizer`` parameters are not used.
A plain ``torch.nn.Module`` with ``optimizer=`` and ``loss=`` (upstream's older way) is trained
through ``legacy.to_lightning_module``; the trained ``TorchModel`` then holds that plain module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from horovod.spark.common.estimator import HorovodEstimator, TrainingSpec
from horovod.spark.common.params import EstimatorParams, declare_params
from horovod.spark.common.persistence import HorovodReadable, HorovodReader, HorovodWritable, HorovodWriter
from horovod.spark.torch.estimator import TorchModel as _TorchModel
from horovod.spark.torch.estimator import trained_model
from horovod.spark.torch.util import ModuleParams, _module_bytes, check_input_shapes

__all__ = ["TorchEstimator", "TorchModel", "lightning_package", "TorchEstimatorParamsWriter",
           "TorchEstimatorParamsReader", "TorchEstimatorParamsWritable",
           "TorchEstimatorParamsReadable", "EstimatorParams", "MIN_PL_VERSION"]


def lightning_package(model: Any) -> str:
    """``"lightning.pytorch"`` or ``"pytorch_lightning"``: the package ``model`` subclasses."""
    for c in type(model).__mro__:
        if c.__module__.startswith("pytorch_lightning"):
            return "pytorch_lightning"
        if c.__module__.startswith("lightning.pytorch"):
            return "lightning.pytorch"
    raise TypeError(f"The Lightning TorchEstimator needs a LightningModule (lightning.pytorch or "
                    f"pytorch_lightning), got {type(model).__name__}.")


class TorchModel(_TorchModel):
    """A trained LightningModule; ``transform(df)`` calls its ``forward`` on batches of rows."""


class TorchEstimator(ModuleParams, HorovodEstimator):
    """Trains a ``LightningModule`` with ``Trainer(strategy=HorovodStrategy())`` on every rank."""

    def _check_model(self) -> None:
        super()._check_model()
        lightning_package(self._lightning_module())

    def _is_plain_module(self) -> bool:
        model = self.getModel()
        try:
            lightning_package(model)
            return False
        except TypeError:
            import torch

            return isinstance(model, torch.nn.Module)

    def _lightning_module(self) -> Any:
        """The model to train: the user's LightningModule, or a plain module wrapped in one."""
        if not self._is_plain_module():
            return self.getModel()
        from horovod.spark.lightning.legacy import to_lightning_module

        return to_lightning_module(self.getModel(), self.getOptimizer(), self.getLoss(), self.getLossWeights(),
                                   list(self.getFeatureCols()), list(self.getLabelCols()),
                                   self.getSampleWeightCol(), self.getValidation(), self.getInputShapes())

    def _check_shapes(self, metadata: dict[str, Any]) -> None:
        check_input_shapes(metadata, list(self.getFeatureCols()), self.getInputShapes())

    def _train_fn(self, spec: TrainingSpec) -> Callable[[], Any]:
        from horovod.spark.lightning.remote import make_train_fn

        module = self._lightning_module()
        spec.update(model_bytes=_module_bytes(module),
                    package=lightning_package(module), callbacks=self.getCallbacks(),
                    logger=self.getLogger(), log_every_n_steps=self.getLogEveryNSteps(),
                    profiler=self.getProfiler(), trainer_args=dict(self.getTrainerArgs() or {}),
                    num_gpus=self.getNumGpus(), use_gpu=self.getUseGpu(),
                    terminate_on_nan=self.getTerminateOnNan())
        return make_train_fn(spec)

    def _make_model(self, result: dict[str, Any], spec: TrainingSpec) -> TorchModel:
        if self._is_plain_module():  # the wrapper's weights are the plain module's, under "model."
            import io

            import torch

            state = torch.load(io.BytesIO(result["state"]), weights_only=True)
            buf = io.BytesIO()
            torch.save({k.removeprefix("model."): v for k, v in state.items()}, buf)
            result = dict(result, state=buf.getvalue())
        return trained_model(TorchModel, self, result, spec)


declare_params(TorchEstimator, [
    ("input_shapes", None, "shape of each feature column's tensor, -1 for the batch"),
    ("num_gpus", None, "GPUs per process (None: one when use_gpu and CUDA is there)"),
    ("logger", None, "a Lightning logger (default: none)"),
    ("log_every_n_steps", 50, "Trainer's log_every_n_steps"),
    ("loader_num_epochs", None, "unused: the reader streams endlessly"),
    ("terminate_on_nan", False, "stop training when the loss becomes NaN"),
    ("profiler", None, "Trainer's profiler"),
    ("trainer_args", None, "a dict merged into the Trainer's arguments"),
    ("debug_data_loader", False, "print the data loader's progress"),
    ("train_async_data_loader_queue_size", None, "batches queued by the training reader"),
    ("val_async_data_loader_queue_size", None, "batches queued by the validation reader"),
])


# Upstream's names for the persistence classes and the params (imported by user code and tests).
TorchEstimatorParamsWriter = HorovodWriter
TorchEstimatorParamsReader = HorovodReader
TorchEstimatorParamsWritable = HorovodWritable
TorchEstimatorParamsReadable = HorovodReadable

# The oldest Lightning this estimator trains with (upstream's examples compare the installed
# version with it and skip below it). Lightning 2 removed the hooks 1.x estimators relied on.
MIN_PL_VERSION = "2.0.0"
