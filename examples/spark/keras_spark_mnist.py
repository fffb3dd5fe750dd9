"""KerasEstimator on Spark: train a small Keras model on scikit-learn's digits (a stand-in for
MNIST) from a DataFrame with a one-hot label vector, then predict with ``transform()``
(upstream's ``keras_spark_mnist.py``, without Petastorm).

    python examples/spark/keras_spark_mnist.py --num-proc 2 --master 'local-cluster[2,1,1024]'
    spark-submit examples/spark/keras_spark_mnist.py --num-proc 4 --work-dir /shared/dir
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_spark_mnist import accuracy, digits_dataframes  # noqa: E402


def build_model() -> Any:
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])


def train_and_evaluate(spark: Any, work_dir: str, num_proc: int = 2, epochs: int = 4,
                       batch_size: int = 32, lr: float = 0.005,
                       **est_kwargs: Any) -> tuple[Any, float]:
    """Fit a ``KerasEstimator`` on the digits and return (the ``KerasModel``, test accuracy)."""
    import keras
    from pyspark.ml.feature import OneHotEncoder

    from horovod.spark.common.store import Store
    from horovod.spark.keras import KerasEstimator

    train_df, test_df = digits_dataframes(spark)
    # One-hot encode the label (a sparse vector column) for categorical cross-entropy.
    encoder = OneHotEncoder(inputCols=["label"], outputCols=["label_vec"], dropLast=False)
    encoder_model = encoder.fit(train_df)
    train_df = encoder_model.transform(train_df)
    keras_estimator = KerasEstimator(num_proc=num_proc, store=Store.create(work_dir),
                                     model=build_model(), optimizer=keras.optimizers.Adam(lr),
                                     loss="categorical_crossentropy", metrics=["accuracy"],
                                     feature_cols=["features"], label_cols=["label_vec"],
                                     batch_size=batch_size, epochs=epochs, validation=0.1,
                                     random_seed=1, verbose=1, **est_kwargs)
    keras_model = keras_estimator.fit(train_df).setOutputCols(["label_prob"])
    return keras_model, accuracy(keras_model.transform(test_df), "label_prob")


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--master", default=None)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)

    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("horovod-keras-spark-mnist")
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
