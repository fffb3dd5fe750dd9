"""TensorFlow 2 training with Horovod: DistributedGradientTape inside a tf.function, variables
broadcast from rank 0 after the first step, checkpoint saved by rank 0 only.

Data: MNIST if a local copy exists (``~/.keras/datasets/mnist.npz`` or ``--mnist PATH``), else
scikit-learn's digits (8x8 images).

    mpirun -np 2 python examples/tensorflow2/tensorflow2_mnist.py
"""

import argparse
import hashlib
import os

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd


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
    parser.add_argument("--steps", type=int, default=1000, help="total steps over all ranks")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--checkpoint-dir", default="./checkpoints")
    parser.add_argument("--mnist", default=None)
    args = parser.parse_args()

    # Initialize Horovod
    hvd.init()

    # Pin GPU to be used to process local rank (one GPU per process)
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    # Different seeds on every rank: the broadcast after the first step makes the weights equal.
    tf.random.set_seed(100 + hvd.rank())
    x_train, y_train, x_test, y_test = load_data(args.mnist)
    dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    dataset = dataset.shard(hvd.size(), hvd.rank()).repeat().shuffle(10000, seed=hvd.rank())
    dataset = dataset.batch(args.batch_size)

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
    loss = tf.losses.SparseCategoricalCrossentropy()
    # Horovod: adjust learning rate based on number of workers.
    opt = tf.optimizers.Adam(0.001 * hvd.size())

    checkpoint = tf.train.Checkpoint(model=mnist_model, optimizer=opt)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            probs = mnist_model(images, training=True)
            loss_value = loss(labels, probs)

        # Horovod: add Horovod Distributed GradientTape.
        tape = hvd.DistributedGradientTape(tape)

        grads = tape.gradient(loss_value, mnist_model.trainable_variables)
        opt.apply_gradients(zip(grads, mnist_model.trainable_variables))

        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        # This is necessary to ensure consistent initialization of all workers when
        # training is started with random weights or restored from a checkpoint.
        #
        # Note: broadcast should be done after the first gradient step to ensure optimizer
        # initialization.
        if first_batch:
            hvd.broadcast_variables(mnist_model.variables, root_rank=0)
            # Keras 3 optimizers expose `variables` as a list; Keras 2 as a method.
            opt_vars = opt.variables() if callable(opt.variables) else opt.variables
            hvd.broadcast_variables(opt_vars, root_rank=0)

        return loss_value

    # Horovod: adjust number of steps based on number of workers.
    for batch, (images, labels) in enumerate(dataset.take(args.steps // hvd.size())):
        loss_value = training_step(images, labels, batch == 0)

        if batch % 100 == 0 and hvd.local_rank() == 0:
            print(f"Step #{batch}\tLoss: {float(loss_value):.6f}", flush=True)

    # Horovod: save checkpoints only on worker 0 to prevent other workers from
    # corrupting it.
    if hvd.rank() == 0:
        # (``--checkpoint-dir`` may contain ``{rank}``, e.g. to show which rank wrote what.)
        checkpoint.save(os.path.join(args.checkpoint_dir.format(rank=hvd.rank()), "ckpt"))

    probs = mnist_model(x_test, training=False)
    acc = float(np.mean(np.argmax(probs, axis=1) == y_test))
    weights = [np.asarray(w) for w in mnist_model.trainable_variables]
    digest = hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest()[:16]
    print(f"RESULT rank={hvd.rank()} accuracy={acc:.4f} weights={digest}", flush=True)


if __name__ == "__main__":
    main()
