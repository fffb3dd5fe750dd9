"""Elastic Keras worker for the tests: ``model.fit`` with the elastic callbacks, every batch the
same, so the weights after N optimizer steps do not depend on the number of workers or on resets
(a lost or doubled step shows). Environment as ``elastic_worker.py`` (STEPS_PER_EPOCH, EPOCHS,
HOSTS_FILE/HOSTS_AT keyed by global step, WAIT_FOR_SIZE "<n>@<step>"). Prints FINAL {json}."""

from __future__ import annotations

import json
import os
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow.keras as hvd  # noqa: E402


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    return x, (x.sum(axis=1, keepdims=True) * 0.5).astype(np.float32)


def make_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                             keras.layers.Dense(1)])


def reference(steps: int) -> list[list[float]]:
    model = make_model()
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    x, y = data()
    for _ in range(steps):
        model.train_on_batch(x, y)
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
    x, y = data()
    ds = tf.data.Dataset.from_tensors((x, y)).repeat()
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    class Schedule(keras.callbacks.Callback):
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
        model.fit(ds, steps_per_epoch=spe, epochs=epochs - state.epoch, callbacks=callbacks,
                  verbose=0)

    train(state)
    final = {"me": me, "rank": hvd.rank(), "size": hvd.size(), "epoch": state.epoch,
             "iterations": int(opt.iterations.numpy()),
             "w": [w.flatten().tolist() for w in model.get_weights()]}
    print(f"FINAL {json.dumps(final)}", flush=True)


if __name__ == "__main__":
    main()
