"""``horovod.spark.torch``: ``TorchEstimator`` trains a ``torch.nn.Module`` on a Spark DataFrame
with Horovod and returns a ``TorchModel`` (a Spark ML ``Model``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from horovod.spark.torch.estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]


def __getattr__(name: str) -> Any:
    # The estimator (Spark ML: PySpark) loads on first use: the ranks of a fit import this
    # package's ``remote`` module only, and need no PySpark (horovod.spark.common.training).
    if name in __all__:
        from horovod.spark.torch import estimator

        value = getattr(estimator, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
