"""A plain ``torch.nn.Module`` given to the Lightning ``TorchEstimator`` with ``optimizer=`` and
``loss=`` (upstream's older way, as its ``pytorch_lightning_spark_mnist_legacy.py`` example uses
it): ``to_lightning_module`` wraps it in a LightningModule that calls the model on the feature
columns (reshaped to ``input_shapes``), computes the weighted loss of every label column, and builds
an optimizer of the given class with the given optimizer's hyperparameters and state."""

from __future__ import annotations

from typing import Any

from horovod.spark.torch.remote import _loss
from horovod.spark.torch.util import _to_tensor

__all__ = ["to_lightning_module", "lightning_base"]


def lightning_base() -> Any:
    """``LightningModule`` of the installed package: ``lightning.pytorch``, else ``pytorch_lightning``."""
    module: Any
    try:
        import lightning.pytorch as module
    except ImportError:
        import pytorch_lightning as module
    return module.LightningModule


def _columns(batch: dict[str, Any], cols: list[str], shapes: list[Any] | None) -> list[Any]:
    import torch

    out = []
    for i, c in enumerate(cols):
        t = batch[c]
        t = _to_tensor(t.cpu().numpy(), shapes[i] if shapes else None) if shapes else t
        out.append(t.float() if t.dtype in (torch.float64, torch.bool) else t)
    return out


def to_lightning_module(model: Any, optimizer: Any, loss_fns: Any, loss_weights: list[float] | None,
                        feature_cols: list[str], label_cols: list[str], sample_weights_col: str | None,
                        validation: Any, input_shapes: list[Any] | None = None) -> Any:
    """A LightningModule training ``model`` with ``optimizer``'s class, hyperparameters and state
    and the ``loss_fns`` (one, or one per label column) weighted by ``loss_weights``; with
    ``validation``, it also reports ``val_loss``."""
    base = lightning_base()
    fns = list(loss_fns) if isinstance(loss_fns, (list, tuple)) else [loss_fns] * len(label_cols)
    if len(fns) != len(label_cols):
        raise ValueError(f"the estimator has {len(label_cols)} label columns ({label_cols}) but "
                         f"{len(fns)} loss functions: give one loss, or one per label column")
    if optimizer is None or loss_fns is None:
        raise ValueError("a torch.nn.Module needs optimizer= and loss= (a LightningModule defines "
                         "configure_optimizers and training_step instead)")

    class _EstimatorModule(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self._optimizer_cls, self._optimizer_defaults = type(optimizer), dict(optimizer.defaults)
            self._optimizer_state = optimizer.state_dict()

        def forward(self, *inputs: Any) -> Any:
            return self.model(*inputs)

        def configure_optimizers(self) -> Any:
            opt = self._optimizer_cls(self.parameters(), **self._optimizer_defaults)
            opt.load_state_dict(self._optimizer_state)
            return opt

        def _loss(self, batch: dict[str, Any]) -> Any:
            outputs = self(*_columns(batch, feature_cols, input_shapes))
            outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
            labels = _columns(batch, label_cols, None)
            weights = batch[sample_weights_col].float() if sample_weights_col else None
            return _loss(fns, loss_weights, outputs, labels, weights)

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            loss = self._loss(batch)
            self.log("train_loss", loss)
            return loss

        if validation:
            def validation_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
                loss = self._loss(batch)
                self.log("val_loss", loss, sync_dist=True)
                return loss

    _EstimatorModule.__qualname__ = _EstimatorModule.__name__ = f"Lightning{type(model).__name__}"
    return _EstimatorModule()
