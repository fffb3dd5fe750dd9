"""tf.keras training with Horovod: hvd.DistributedOptimizer, BroadcastGlobalVariablesCallback(0),
model.fit with steps_per_epoch scaled by the number of workers.

Works with Keras 3 (default) and with Keras 2 (``TF_USE_LEGACY_KERAS=1``, where the recipe's
``experimental_run_tf_function=False`` is passed to ``compile``; Keras 3 has no such argument).
Data: MNIST if a local copy exists (``~/.keras/datasets/mnist.npz`` or ``--mnist PATH``), else
scikit-learn's digits (8x8 images).

    mpirun -np 2 python examples/keras/keras_mnist.py
    TF_USE_LEGACY_KERAS=1 mpirun -np 2 -x TF_USE_LEGACY_KERAS python examples/keras/keras_mnist.py
"""

import argparse
import hashlib
import os

import numpy as np
import tensorflow as tf

import horovod.tensorflow.keras as hvd


def load_data(mnist_path):
    """Return (x_train, y_train, x_test, y_test): float32 NHWC images in [0, 1], int64 labels."""
    path = os.path.expanduser(mnist_path or "~/.keras/datasets/mnist.npz")
    if os.path.exists(path):
        with np.load(path) as f:
            x_tr, y_tr, x_te, y_te = f["x_train"], f["y_train"], f["x_test"], f["y_test"]
        scale = 255.0
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x, y = digits.images, digits.target
        perm = np.random.RandomState(0).permutation(len(x))
        x, y = x[perm], y[perm]
        x_tr, y_tr, x_te, y_te = x[:1400], y[:1400], x[1400:], y[1400:]
        scale = 16.0
    prep = lambda a: (a[..., np.newaxis] / scale).astype(np.float32)
    return prep(x_tr), y_tr.astype(np.int64), prep(x_te), y_te.astype(np.int64)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--steps-per-epoch", type=int, default=200, help="over all ranks")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--checkpoint-dir", default="./keras-checkpoints")
    parser.add_argument("--mnist", default=None)
    args = parser.parse_args()

    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process)
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    tf.random.set_seed(200 + hvd.rank())  # different initial weights on every rank
    x_train, y_train, x_test, y_test = load_data(args.mnist)
    dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    dataset = dataset.repeat().shuffle(10000, seed=hvd.rank()).batch(args.batch_size)

    mnist_model = tf.keras.Sequential([
        tf.keras.Input(shape=x_train.shape[1:]),
        tf.keras.layers.Conv2D(32, [3, 3], activation="relu"),
        tf.keras.layers.Conv2D(64, [3, 3], activation="relu"),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])

    # Horovod: adjust learning rate based on number of GPUs.
    opt = tf.optimizers.Adam(0.001 * hvd.size())

    # Horovod: add Horovod DistributedOptimizer.
    opt = hvd.DistributedOptimizer(opt)

    # Horovod: Specify `experimental_run_tf_function=False` to ensure TensorFlow
    # uses hvd.DistributedOptimizer() to compute gradients (Keras 2 only; Keras 3 has no such
    # argument and always applies gradients through the optimizer).
    keras2 = tf.keras.__name__.startswith("tf_keras") or tf.keras.__version__.startswith("2.")
    extra = {"experimental_run_tf_function": False} if keras2 else {}
    mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                        optimizer=opt,
                        metrics=["accuracy"],
                        **extra)

    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        # This is necessary to ensure consistent initialization of all workers when
        # training is started with random weights or restored from a checkpoint.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Horovod: average metrics among workers at the end of every epoch.
        hvd.callbacks.MetricAverageCallback(),
    ]

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    # (``--checkpoint-dir`` may contain ``{rank}``, e.g. to show which rank wrote what.)
    if hvd.rank() == 0:
        args.checkpoint_dir = args.checkpoint_dir.format(rank=hvd.rank())
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        name = "checkpoint-{epoch}.weights.h5" if not keras2 else "checkpoint-{epoch}.h5"
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(os.path.join(args.checkpoint_dir, name),
                                                            save_weights_only=True))

    # Horovod: write logs on worker 0.
    verbose = 2 if hvd.rank() == 0 else 0

    # Train the model.
    # Horovod: adjust number of steps based on number of GPUs.
    mnist_model.fit(dataset, steps_per_epoch=args.steps_per_epoch // hvd.size(), callbacks=callbacks,
                    epochs=args.epochs, verbose=verbose)

    probs = mnist_model.predict(x_test, verbose=0)
    acc = float(np.mean(np.argmax(probs, axis=1) == y_test))
    weights = [np.asarray(w) for w in mnist_model.trainable_weights]
    digest = hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest()[:16]
    print(f"RESULT rank={hvd.rank()} accuracy={acc:.4f} weights={digest}", flush=True)


if __name__ == "__main__":
    main()
