"""The Lightning estimator on Spark: a ``LightningModule`` trained on scikit-learn's digits (a
stand-in for MNIST) from a DataFrame through ``Trainer(strategy="horovod")`` on every Spark
task, then ``transform()`` (upstream's ``pytorch_lightning_spark_mnist.py``, without Petastorm).

    python examples/spark/pytorch_lightning_spark_mnist.py --num-proc 2 --master 'local-cluster[2,1,1024]'
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_spark_mnist import accuracy, digits_dataframes  # noqa: E402


class Net(pl.LightningModule):
    """The batches are dicts of the DataFrame's columns: ``batch['features']``, ``batch['label']``."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.lr = lr
        self.conv = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().reshape(-1, 1, 8, 8)
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=-1)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch["features"], batch["label"].long()
        loss = F.nll_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        x, y = batch["features"], batch["label"].long()
        self.log("val_loss", F.nll_loss(self(x), y), sync_dist=True)


def train_and_evaluate(spark: Any, work_dir: str, num_proc: int = 2, epochs: int = 4,
                       batch_size: int = 32, **est_kwargs: Any) -> tuple[Any, float]:
    """Fit the Lightning ``TorchEstimator`` on the digits; return (``TorchModel``, accuracy)."""
    from horovod.spark.common.store import Store
    from horovod.spark.lightning import TorchEstimator

    train_df, test_df = digits_dataframes(spark)
    torch.manual_seed(0)
    estimator = TorchEstimator(num_proc=num_proc, store=Store.create(work_dir), model=Net(),
                               input_shapes=[[-1, 1, 8, 8]], feature_cols=["features"],
                               label_cols=["label"], batch_size=batch_size, epochs=epochs,
                               validation=0.1, random_seed=1, verbose=1, **est_kwargs)
    torch_model = estimator.fit(train_df).setOutputCols(["label_prob"])
    return torch_model, accuracy(torch_model.transform(test_df), "label_prob")


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--master", default=None)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)

    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("horovod-lightning-spark-mnist")
    if args.master:
        builder = builder.master(args.master)
    spark = builder.getOrCreate()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            _, acc = train_and_evaluate(spark, args.work_dir or tmp, args.num_proc, args.epochs,
                                        args.batch_size)
    finally:
        spark.stop()
    print(f"Test accuracy: {acc:.4f}")
    return acc


if __name__ == "__main__":
    main()
