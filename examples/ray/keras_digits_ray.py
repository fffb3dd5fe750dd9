"""Keras training with Horovod, launched on a Ray cluster by ``horovod.ray.RayExecutor``.

The training function is upstream Horovod's Keras recipe as written (``hvd.init()``, learning
rate scaled by ``hvd.size()``, ``hvd.DistributedOptimizer``,
``hvd.callbacks.BroadcastGlobalVariablesCallback(0)``, ``MetricAverageCallback``, checkpoints
on rank 0 only, ``steps_per_epoch`` divided by ``hvd.size()``), on scikit-learn's digits. Works
with Keras 3 and with Keras 2 (``TF_USE_LEGACY_KERAS=1``, passed on to the workers).

    python examples/ray/keras_digits_ray.py
    python examples/ray/keras_digits_ray.py --address auto        # a running cluster (ray start)
"""

from __future__ import annotations

import argparse
import os
import tempfile

import ray

from horovod.ray import RayExecutor


def train(epochs: int, steps_per_epoch: int, batch_size: int, checkpoint_dir: str) -> dict:
    """Runs on every rank (a Ray actor): the Horovod Keras recipe."""
    import hashlib

    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits

    import horovod.tensorflow.keras as hvd

    # Horovod: initialize Horovod.
    hvd.init()
    # Horovod: pin GPU to be used to process local rank (one GPU per process).
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    tf.random.set_seed(200 + hvd.rank())  # different initial weights: the broadcast fixes them
    digits = load_digits()
    x = (digits.images[..., np.newaxis] / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
    dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    dataset = dataset.repeat().shuffle(2000, seed=hvd.rank()).batch(batch_size)

    model = tf.keras.Sequential([
        tf.keras.Input(shape=(8, 8, 1)),
        tf.keras.layers.Conv2D(32, [3, 3], activation="relu"),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])
    # Horovod: adjust the learning rate based on the number of workers.
    opt = tf.optimizers.Adam(0.001 * hvd.size())
    # Horovod: add Horovod DistributedOptimizer.
    opt = hvd.DistributedOptimizer(opt)
    keras2 = tf.keras.__name__.startswith("tf_keras") or tf.keras.__version__.startswith("2.")
    extra = {"experimental_run_tf_function": False} if keras2 else {}
    model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt,
                  metrics=["accuracy"], **extra)
    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Horovod: average metrics among workers at the end of every epoch.
        hvd.callbacks.MetricAverageCallback(),
    ]
    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    if hvd.rank() == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
        name = "checkpoint-{epoch}.h5" if keras2 else "checkpoint-{epoch}.weights.h5"
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(os.path.join(checkpoint_dir, name),
                                                            save_weights_only=True))
    # Horovod: adjust the number of steps based on the number of workers.
    history = model.fit(dataset, steps_per_epoch=steps_per_epoch // hvd.size(), epochs=epochs,
                        callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)
    probs = model.predict(x_test, verbose=0)
    accuracy = float(np.mean(np.argmax(probs, axis=1) == y_test))
    weights = b"".join(np.asarray(w).tobytes() for w in model.trainable_weights)
    return {"rank": hvd.rank(), "size": hvd.size(), "accuracy": accuracy,
            "loss": float(history.history["loss"][-1]),
            "weights": hashlib.sha256(weights).hexdigest()[:16]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start one here)")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps-per-epoch", type=int, default=100, help="over all ranks")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--checkpoint-dir", default=os.path.join(tempfile.gettempdir(), "horovod_ray_keras"))
    args = parser.parse_args()

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.num_workers, include_dashboard=False, object_store_memory=200 * 1024 * 1024)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=args.num_workers)
    # Keras 2 or 3 in the workers as here.
    env = {k: os.environ[k] for k in ("TF_USE_LEGACY_KERAS", "TF_CPP_MIN_LOG_LEVEL") if k in os.environ}
    executor.start(extra_env_vars=env)
    try:
        results = executor.run(train, kwargs={"epochs": args.epochs, "steps_per_epoch": args.steps_per_epoch,
                                              "batch_size": args.batch_size,
                                              "checkpoint_dir": args.checkpoint_dir})
    finally:
        executor.shutdown()
    for r in results:
        print(f"RESULT rank={r['rank']} size={r['size']} accuracy={r['accuracy']:.4f} "
              f"loss={r['loss']:.4f} weights={r['weights']}", flush=True)


if __name__ == "__main__":
    main()
