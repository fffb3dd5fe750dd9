"""``horovod.spark.lightning``: ``TorchEstimator`` (docs: "LightningEstimator") trains a
``LightningModule`` on a Spark DataFrame through Lightning's ``Trainer`` with the Horovod strategy
(``horovod.lightning``) and returns a ``TorchModel``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from horovod.spark.lightning.estimator import TorchEstimator, TorchModel

    LightningEstimator = TorchEstimator

__all__ = ["TorchEstimator", "TorchModel", "LightningEstimator"]


def __getattr__(name: str) -> Any:
    # The estimator (Spark ML: PySpark) loads on first use: the ranks of a fit import this
    # package's ``remote`` module only, and need no PySpark (horovod.spark.common.training).
    if name in __all__:
        from horovod.spark.lightning import estimator

        value = getattr(estimator, "TorchEstimator" if name == "LightningEstimator" else name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
