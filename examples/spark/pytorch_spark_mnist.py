"""TorchEstimator on Spark: train a small CNN on scikit-learn's digits (8x8 images, a stand-in
for MNIST) from a DataFrame, then predict with ``transform()`` (upstream's
``pytorch_spark_mnist.py``, without Petastorm).

    python examples/spark/pytorch_spark_mnist.py --num-proc 2 --master 'local-cluster[2,1,1024]'
    spark-submit examples/spark/pytorch_spark_mnist.py --num-proc 4 --work-dir /shared/dir

``--work-dir`` must be a directory every executor can read and write (the store: prepared data,
checkpoints, logs), e.g. an NFS path, ``hdfs://...`` or ``s3://...``.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=-1)


def digits_dataframes(spark: Any, seed: int = 1) -> tuple[Any, Any]:
    """(train, test) DataFrames of digits: ``features`` (a dense vector of 64 pixels in [0, 1])
    and ``label`` (0-9)."""
    from pyspark.ml.linalg import Vectors
    from sklearn.datasets import load_digits

    digits = load_digits()
    rows = [(Vectors.dense(x / 16.0), int(y)) for x, y in zip(digits.data, digits.target)]
    df = spark.createDataFrame(rows, ["features", "label"])
    return df.randomSplit([0.85, 0.15], seed=seed)


def accuracy(pred_df: Any, output_col: str) -> float:
    """Argmax of the predicted vector against ``label``, as upstream's example measures it."""
    import numpy as np
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.sql import functions as F
    from pyspark.sql.types import DoubleType

    argmax = F.udf(lambda v: float(np.argmax(v.toArray())), DoubleType())
    pred_df = pred_df.withColumn("label_pred", argmax(F.col(output_col))) \
        .withColumn("label", F.col("label").cast("double"))
    evaluator = MulticlassClassificationEvaluator(predictionCol="label_pred", labelCol="label",
                                                  metricName="accuracy")
    return float(evaluator.evaluate(pred_df))


def train_and_evaluate(spark: Any, work_dir: str, num_proc: int = 2, epochs: int = 4,
                       batch_size: int = 32, lr: float = 0.01, **est_kwargs: Any) -> tuple[Any, float]:
    """Fit a ``TorchEstimator`` on the digits and return (the ``TorchModel``, test accuracy)."""
    from horovod.spark.common.store import Store
    from horovod.spark.torch import TorchEstimator

    train_df, test_df = digits_dataframes(spark)
    store = Store.create(work_dir)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    # Train a Horovod Spark Estimator on the DataFrame.
    torch_estimator = TorchEstimator(num_proc=num_proc, store=store, model=model,
                                     optimizer=optimizer, loss=F.nll_loss,
                                     input_shapes=[[-1, 1, 8, 8]], feature_cols=["features"],
                                     label_cols=["label"], batch_size=batch_size, epochs=epochs,
                                     validation=0.1, random_seed=1, verbose=1, **est_kwargs)
    torch_model = torch_estimator.fit(train_df).setOutputCols(["label_prob"])
    # Evaluate the model on the held-out test DataFrame.
    return torch_model, accuracy(torch_model.transform(test_df), "label_prob")


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-proc", type=int, default=2, help="Horovod processes (Spark tasks)")
    parser.add_argument("--master", default=None, help="Spark master, e.g. local-cluster[2,1,1024]")
    parser.add_argument("--work-dir", default=None, help="the store (default: a temporary dir)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)

    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("horovod-pytorch-spark-mnist")
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
