"""The TF2 and Keras seed recipes nearly verbatim, under Keras 2 (TF_USE_LEGACY_KERAS=1).

Only the data loading differs (digits instead of downloading MNIST). This is where the recipes'
Keras-2-only spellings run as written: ``opt.variables()`` and ``experimental_run_tf_function=False``.
Prints ``RESULT <recipe> rank=<r> accuracy=<a> weights=<digest>``.
"""
import hashlib
import sys

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd

assert tf.keras.__name__.startswith("tf_keras"), "run with TF_USE_LEGACY_KERAS=1"
steps_scale = int(sys.argv[1]) if len(sys.argv) > 1 else 1

digits = load_digits()
images = (digits.images[..., np.newaxis] / 16.0).astype(np.float32)
labels = digits.target.astype(np.int64)


def report(recipe, model):
    acc = float(np.mean(np.argmax(model.predict(images[1400:], verbose=0), 1) == labels[1400:]))
    digest = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.get_weights())).hexdigest()[:16]
    print(f"RESULT {recipe} rank={hvd.rank()} accuracy={acc:.4f} weights={digest}", flush=True)


def make_model():
    return tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, [3, 3], activation='relu'),
        tf.keras.layers.Conv2D(64, [3, 3], activation='relu'),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation='softmax')
    ])


# ----------------------------------------------------------------------------- TF2 recipe (seed 003)
hvd_tf.init()
tf.random.set_seed(hvd_tf.rank())
dataset = tf.data.Dataset.from_tensor_slices((images[:1400], labels[:1400])).repeat().shuffle(1000).batch(32)
mnist_model = make_model()
loss = tf.losses.SparseCategoricalCrossentropy()
opt = tf.optimizers.Adam(0.001 * hvd_tf.size())


@tf.function
def training_step(images, labels, first_batch):
    with tf.GradientTape() as tape:
        probs = mnist_model(images, training=True)
        loss_value = loss(labels, probs)

    # Horovod: add Horovod Distributed GradientTape.
    tape = hvd_tf.DistributedGradientTape(tape)

    grads = tape.gradient(loss_value, mnist_model.trainable_variables)
    opt.apply_gradients(zip(grads, mnist_model.trainable_variables))

    if first_batch:
        hvd_tf.broadcast_variables(mnist_model.variables, root_rank=0)
        hvd_tf.broadcast_variables(opt.variables(), root_rank=0)

    return loss_value


for batch, (imgs, lbls) in enumerate(dataset.take(300 * steps_scale // hvd_tf.size())):
    loss_value = training_step(imgs, lbls, batch == 0)
report("tf2", mnist_model)

# ----------------------------------------------------------------------------- Keras recipe (seed 004)
dataset = tf.data.Dataset.from_tensor_slices(
    (tf.cast(images[:1400], tf.float32), tf.cast(labels[:1400], tf.int64))
)
dataset = dataset.repeat().shuffle(10000).batch(128)
mnist_model = make_model()

# Horovod: adjust learning rate based on number of GPUs.
opt = tf.optimizers.Adam(0.001 * hvd.size())

# Horovod: add Horovod DistributedOptimizer.
opt = hvd.DistributedOptimizer(opt)

# Horovod: Specify `experimental_run_tf_function=False` to ensure TensorFlow
# uses hvd.DistributedOptimizer() to compute gradients.
mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                    optimizer=opt,
                    metrics=['accuracy'],
                    experimental_run_tf_function=False)

callbacks = [
    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    # This is necessary to ensure consistent initialization of all workers when
    # training is started with random weights or restored from a checkpoint.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
]

# Horovod: write logs on worker 0.
verbose = 1 if hvd.rank() == 0 else 0

# Train the model.
# Horovod: adjust number of steps based on number of GPUs.
mnist_model.fit(dataset, steps_per_epoch=100 * steps_scale // hvd.size(), callbacks=callbacks, epochs=4,
                verbose=0)
report("keras", mnist_model)
