"""TF1-style training with Horovod: DistributedOptimizer + BroadcastGlobalVariablesHook +
MonitoredTrainingSession, checkpoints written by rank 0 only (the recipe of Horovod's README).

Runs on TensorFlow 2 through ``tf.compat.v1``. Data: MNIST if a local copy exists
(``~/.keras/datasets/mnist.npz`` or ``--mnist PATH``), else scikit-learn's digits (8x8 images).

    mpirun -np 2 python examples/tensorflow/tensorflow_mnist.py
"""

import argparse
import hashlib
import os

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd

tf.compat.v1.disable_eager_execution()


def load_data(mnist_path):
    """Return (x_train, y_train, x_test, y_test) as float32 images in [0, 1] and int64 labels."""
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
    prep = lambda a: (a.reshape(len(a), -1) / scale).astype(np.float32)
    return prep(x_tr), y_tr.astype(np.int64), prep(x_te), y_te.astype(np.int64)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1200, help="total steps over all ranks")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint-dir", default="/tmp/train_logs")
    parser.add_argument("--mnist", default=None)
    args = parser.parse_args()

    # Initialize Horovod
    hvd.init()

    # Pin GPU to be used to process local rank (one GPU per process)
    config = tf.compat.v1.ConfigProto()
    config.gpu_options.visible_device_list = str(hvd.local_rank())

    x_train, y_train, x_test, y_test = load_data(args.mnist)
    n_in, n_hidden, n_out = x_train.shape[1], 128, 10

    # Each rank reads its own shard; rank-dependent seeds make the initial weights differ, so the
    # broadcast hook is what makes them equal.
    tf.compat.v1.set_random_seed(1234 + hvd.rank())
    dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
               .shard(hvd.size(), hvd.rank()).repeat().shuffle(1000, seed=hvd.rank())
               .batch(args.batch_size))
    images, labels = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()

    # Build model...
    init = tf.compat.v1.glorot_uniform_initializer()
    w1 = tf.compat.v1.get_variable("w1", [n_in, n_hidden], initializer=init)
    b1 = tf.compat.v1.get_variable("b1", [n_hidden], initializer=tf.compat.v1.zeros_initializer())
    w2 = tf.compat.v1.get_variable("w2", [n_hidden, n_out], initializer=init)
    b2 = tf.compat.v1.get_variable("b2", [n_out], initializer=tf.compat.v1.zeros_initializer())

    def logits_of(x):
        return tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) + b2

    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                                         logits=logits_of(images)))
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits_of(tf.constant(x_test)), 1),
                                               tf.constant(y_test)), tf.float32))
    opt = tf.compat.v1.train.AdagradOptimizer(args.lr * hvd.size())

    # Add Horovod Distributed Optimizer
    opt = hvd.DistributedOptimizer(opt)

    global_step = tf.compat.v1.train.get_or_create_global_step()
    # Add hook to broadcast variables from rank 0 to all other processes during
    # initialization.
    hooks = [hvd.BroadcastGlobalVariablesHook(0),
             # Horovod: adjust number of steps based on number of workers.
             tf.compat.v1.train.StopAtStepHook(last_step=args.steps // hvd.size())]

    # Make training operation
    train_op = opt.minimize(loss, global_step=global_step)

    # Save checkpoints only on worker 0 to prevent other workers from corrupting them.
    # (``--checkpoint-dir`` may contain ``{rank}``, e.g. to show which rank wrote what.)
    checkpoint_dir = args.checkpoint_dir.format(rank=hvd.rank()) if hvd.rank() == 0 else None

    # The MonitoredTrainingSession takes care of session initialization,
    # restoring from a checkpoint, saving to a checkpoint, and closing when done
    # or an error occurs.
    with tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir, config=config,
                                                     hooks=hooks) as mon_sess:
        step = 0
        while not mon_sess.should_stop():
            # Perform synchronous training.
            _, loss_value = mon_sess.run([train_op, loss])
            if step % 100 == 0 and hvd.rank() == 0:
                print(f"step {step} loss {loss_value:.4f}", flush=True)
            step += 1
        acc, weights = mon_sess.run_step_fn(
            lambda step_context: step_context.session.run([accuracy, [w1, b1, w2, b2]]))
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in weights)).hexdigest()[:16]
    print(f"RESULT rank={hvd.rank()} accuracy={acc:.4f} weights={digest}", flush=True)


if __name__ == "__main__":
    main()
