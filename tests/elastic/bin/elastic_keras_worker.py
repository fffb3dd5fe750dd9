"""Elastic Keras worker for the tests: ``model.fit`` with the elastic callbacks, each rank on its own
batch, so the weights show a lost or doubled step and an optimizer that stopped averaging: the
state records the world size of every committed step (``state.sizes``) and the weights equal
``reference(sizes)``, which averages the ranks' gradients itself. Environment as
``elastic_worker.py`` (STEPS_PER_EPOCH, EPOCHS, HOSTS_FILE/HOSTS_AT keyed by global step,
WAIT_FOR_SIZE "<n>@<step>"). Prints FINAL {json}."""

from __future__ import annotations

import json
import os
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow.keras as hvd  # noqa: E402


def data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(rank)
    x = (rng.standard_normal((8, 4)) + rank).astype(np.float32)
    return x, (x.sum(axis=1, keepdims=True) * 0.5).astype(np.float32)


def make_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                             keras.layers.Dense(1)])


def reference(sizes: list[int]) -> list[list[float]]:
    """One step per entry of ``sizes``: the gradients of ranks ``0..n-1`` averaged, then applied."""
    model = make_model()
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    mse = keras.losses.MeanSquaredError()
    for n in sizes:
        total = None
        for rank in range(n):
            x, y = data(rank)
            with tf.GradientTape() as tape:
                loss = mse(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        opt.apply_gradients(zip([g / n for g in total], model.trainable_variables))
    return [w.flatten().tolist() for w in model.get_weights()]


def main() -> None:
    spe = int(os.environ.get("STEPS_PER_EPOCH", "6"))
    epochs = int(os.environ.get("EPOCHS", "4"))
    hosts_at = json.loads(os.environ.get("HOSTS_AT", "{}"))
    wait_for = os.environ.get("WAIT_FOR_SIZE", "")
    me = f"{os.environ['HOROVOD_ELASTIC_HOST']}[{os.environ['HOROVOD_ELASTIC_SLOT']}]"
    hvd.init()
    model = make_model()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9))
    model.compile(loss="mse", optimizer=opt)
    state = hvd.elastic.KerasState(model, batch=0, epoch=0, sizes=[])

    class Schedule(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
            state.sizes = state.sizes + [hvd.size()]  # committed with this batch's step

        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            step = int(opt.iterations.numpy())
            content = hosts_at.get(str(step))
            marker = f"{os.environ.get('HOSTS_FILE', '')}.done{step}"
            if hvd.rank() == 0 and content is not None and not os.path.exists(marker):
                with open(os.environ["HOSTS_FILE"] + ".tmp", "w") as fh:
                    fh.write(content)
                os.replace(os.environ["HOSTS_FILE"] + ".tmp", os.environ["HOSTS_FILE"])
                open(marker, "w").close()
            if wait_for:
                n, _, at = wait_for.partition("@")
                for _ in range(450):
                    if step != int(at) or hvd.size() >= int(n):
                        break
                    time.sleep(0.2)
                    state.check_host_updates()
            time.sleep(0.05)

    callbacks = [hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state), Schedule()]

    @hvd.elastic.run
    def train(state: hvd.elastic.KerasState) -> None:
        ds = tf.data.Dataset.from_tensors(data(hvd.rank())).repeat()  # this rank's, after every reset
        model.fit(ds, steps_per_epoch=spe, epochs=epochs - state.epoch, callbacks=callbacks,
                  verbose=0)

    train(state)
    final = {"me": me, "rank": hvd.rank(), "size": hvd.size(), "epoch": state.epoch,
             "iterations": int(opt.iterations.numpy()),
             "w": [w.flatten().tolist() for w in model.get_weights()], "sizes": state.sizes}
    print(f"FINAL {json.dumps(final)}", flush=True)


if __name__ == "__main__":
    main()
