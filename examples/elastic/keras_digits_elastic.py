"""Elastic Keras training (``model.fit``) on scikit-learn's digits.

    printf '#!/bin/sh\\ncat hosts.txt\\n' > discover.sh && chmod +x discover.sh
    printf 'localhost:2\\n' > hosts.txt
    horovodrun -np 2 --min-np 1 --max-np 3 --host-discovery-script ./discover.sh \\
        python examples/elastic/keras_digits_elastic.py
    # meanwhile: printf 'localhost:2\\n127.0.0.1:1\\n' > hosts.txt   (a worker joins)

However fast the training, ``--finish-with-workers 2`` keeps it going (past ``--epochs``, one epoch
at a time) until an epoch ends with two workers, so a worker you add always takes part.

The Horovod elastic recipe is marked with "Horovod:" comments: ``KerasState`` keeps the model,
its optimizer and the epoch/batch counters; the elastic callbacks keep them up to date and commit.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import horovod.tensorflow.keras as hvd  # noqa: E402

parser = argparse.ArgumentParser(description="Elastic Keras digits example")
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.01, help="learning rate of one worker")
parser.add_argument("--finish-with-workers", type=int, default=1, metavar="N",
                    help="train past --epochs, one epoch at a time, until an epoch ends with at "
                         "least N workers (default 1: stop after --epochs), so that workers you "
                         "add take part however fast the training is")
args = parser.parse_args()

# Horovod: initialize (in an elastic job this joins the driver's current round).
hvd.init()

digits = load_digits()
x = (digits.data / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
y = digits.target.astype(np.int64)
steps_per_epoch = 1500 // args.batch_size
dataset = tf.data.Dataset.from_tensor_slices((x[:1500], y[:1500])).shuffle(1500, seed=42) \
    .repeat().batch(args.batch_size)

model = keras.Sequential([
    keras.Input((8, 8, 1)),
    keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
    keras.layers.MaxPooling2D(),
    keras.layers.Flatten(),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(10),
])
# Horovod: wrap the optimizer; scale the learning rate with the number of workers.
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9))
model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])

# Horovod: the state to keep across resets.
state = hvd.elastic.KerasState(model, batch=0, epoch=0, last_epoch_workers=0)


def on_reset() -> None:
    # Horovod: the number of workers changed: rescale the learning rate.
    opt.learning_rate.assign(args.lr * hvd.size())


state.register_reset_callbacks([on_reset])


def epoch_ended(epoch: int, logs: dict | None = None) -> None:
    state.last_epoch_workers = hvd.size()
    if hvd.rank() == 0:
        print(f"epoch {state.epoch - 1}: {hvd.size()} workers, loss {(logs or {}).get('loss', 0):.3f}"
              f", accuracy {(logs or {}).get('accuracy', 0):.3f}", flush=True)


callbacks = [
    # Horovod: keep state.batch / state.epoch current, then commit every 5 batches.
    hvd.elastic.UpdateBatchStateCallback(state),
    hvd.elastic.UpdateEpochStateCallback(state),
    keras.callbacks.LambdaCallback(on_epoch_end=epoch_ended),  # before the epoch's commit
    hvd.elastic.CommitStateCallback(state, batches_per_commit=5),
]


@hvd.elastic.run
def train(state: hvd.elastic.KerasState) -> None:
    # Horovod: the state is the same on every worker, so all of them decide alike.
    while state.epoch < args.epochs or state.last_epoch_workers < args.finish_with_workers:
        model.fit(dataset, steps_per_epoch=steps_per_epoch, epochs=max(args.epochs - state.epoch, 1),
                  callbacks=callbacks, verbose=0)


train(state)
if hvd.rank() == 0:
    loss, acc = model.evaluate(x[1500:], y[1500:], verbose=0)
    print(f"done: test accuracy {acc:.3f} on {hvd.size()} workers", flush=True)
