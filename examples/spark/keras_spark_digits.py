"""Keras training (``model.fit``) on scikit-learn's digits, launched from Spark.

    python examples/spark/keras_spark_digits.py --num-proc 2 --master 'local-cluster[2,1,1024]'

``train`` is the usual Horovod Keras recipe (marked "Horovod:"); ``horovod.spark.run`` runs it
on ``num_proc`` Spark tasks and returns each rank's result in rank order.
"""

from __future__ import annotations

import argparse
from typing import Any


def train(epochs: int = 3, lr: float = 0.01, batch_size: int = 32) -> dict[str, Any]:
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits

    import horovod.tensorflow.keras as hvd

    # Horovod: initialize.
    hvd.init()
    # Horovod: pin the GPU of this process to its local rank.
    gpus = tf.config.experimental.list_physical_devices("GPU")
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")
    tf.random.set_seed(42 + hvd.rank())  # different initial weights: the broadcast fixes that

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    y = digits.target.astype(np.int64)
    # Horovod: each rank trains on its own shard of the data.
    shard_x, shard_y = x[:1500][hvd.rank()::hvd.size()], y[:1500][hvd.rank()::hvd.size()]

    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    # Horovod: scale the learning rate by the number of workers and wrap the optimizer.
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr * hvd.size(), momentum=0.9))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [
        # Horovod: broadcast the initial variables from rank 0 to all other processes.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Horovod: average the metrics over the ranks at the end of every epoch.
        hvd.callbacks.MetricAverageCallback(),
    ]
    history = model.fit(shard_x, shard_y, batch_size=batch_size, epochs=epochs, callbacks=callbacks,
                        verbose=2 if hvd.rank() == 0 else 0)
    _, accuracy = model.evaluate(x[1500:], y[1500:], verbose=0)
    params = np.concatenate([w.reshape(-1) for w in model.get_weights()])
    return {"rank": hvd.rank(), "size": hvd.size(), "accuracy": float(accuracy),
            "loss": [float(v) for v in history.history["loss"]], "params": params}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-proc", type=int, default=2, help="Horovod processes (Spark tasks)")
    parser.add_argument("--master", default=None,
                        help="Spark master when not under spark-submit, e.g. local-cluster[2,1,1024]")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    from pyspark.sql import SparkSession

    import horovod.spark

    builder = SparkSession.builder.appName("horovod-keras-digits")
    if args.master:
        builder = builder.master(args.master)
    spark = builder.getOrCreate()
    try:
        results = horovod.spark.run(train, kwargs={"epochs": args.epochs}, num_proc=args.num_proc)
    finally:
        spark.stop()
    for r in results:
        print(f"rank {r['rank']} of {r['size']}: test accuracy {r['accuracy']:.3f}")
    return results


if __name__ == "__main__":
    main()
