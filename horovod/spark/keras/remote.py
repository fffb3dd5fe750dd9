"""What every rank of a ``KerasEstimator.fit`` runs (shipped to the Spark tasks)."""

from __future__ import annotations

import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

# upstream's module constants, imported from here by user code
from horovod.spark.common.constants import BYTES_PER_GIB, TOTAL_BUFFER_MEMORY_CAP_GIB  # noqa: F401
from horovod.spark.common.training import TrainingSpec

__all__ = ["make_train_fn"]


def _batches(reader: Any, spec: TrainingSpec) -> Iterator[tuple[Any, ...]]:
    """``(x, y)`` batches, ``(x, y, sample_weight)`` with a ``sample_weight_col``: training and
    validation data alike, as upstream (the validation loss is weighted as the training one)."""
    from horovod.spark.keras.util import _shaped

    shapes = spec["input_shapes"]
    for batch in reader:
        xs = [_shaped(batch[c], shapes[i] if shapes else None)
              for i, c in enumerate(spec["feature_cols"])]
        ys = []
        for c in spec["label_cols"]:
            y = batch[c]
            ys.append(y.astype(np.float32) if y.dtype in (np.float64, np.bool_) else y)
        x = xs[0] if len(xs) == 1 else tuple(xs)
        y = ys[0] if len(ys) == 1 else tuple(ys)
        if spec["sample_weight_col"]:
            yield x, y, batch[spec["sample_weight_col"]].astype(np.float32)
        else:
            yield x, y


def make_train_fn(spec: TrainingSpec) -> Callable[[], Any]:
    def train() -> dict[str, Any] | None:
        import os

        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        if spec["flavour"] == "tf_keras":
            os.environ["TF_USE_LEGACY_KERAS"] = "1"
        import tensorflow as tf

        import horovod.tensorflow.keras as hvd
        from horovod.spark.common.training import data_module_for
        from horovod.spark.keras.util import keras_module, model_from_bytes

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        if spec["random_seed"] is not None:
            tf.random.set_seed(spec["random_seed"])
        k: Any = keras_module(spec["flavour"])  # Keras 3 or tf_keras: the model's own
        store, ckpt_path = spec["store"], spec["checkpoint_path"]
        model = model_from_bytes(spec["model_bytes"], spec["flavour"], spec["custom_objects"])
        history: dict[str, list[float]] = {}
        start = 0
        ckpt = pickle.loads(store.read_bytes(ckpt_path)) if store.exists(ckpt_path) else None
        if ckpt is not None:
            model.set_weights(ckpt["weights"])
            history, start = ckpt["history"], ckpt["epoch"] + 1
            if rank == 0 and spec["verbose"]:
                print(f"resuming run {spec['run_id']} after epoch {ckpt['epoch']}", flush=True)
        opt = k.optimizers.deserialize(spec["optimizer_config"])
        opt = hvd.DistributedOptimizer(
            opt, compression=spec["gradient_compression"] or hvd.Compression.none,
            backward_passes_per_step=spec["backward_passes_per_step"])
        model.compile(optimizer=opt, loss=spec["loss"], loss_weights=spec["loss_weights"],
                      metrics=list(spec["metrics"] or []))
        if ckpt is not None and ckpt.get("optimizer") is not None:
            restore_optimizer(opt, model, ckpt["optimizer"])

        class Checkpoint(k.callbacks.Callback):
            """Rank 0 writes the weights, the optimizer's variables (slots, step count), epoch
            and history after every epoch (atomically)."""

            def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
                for key, v in (logs or {}).items():
                    history.setdefault(key, []).append(float(v))
                if rank == 0:
                    store.write_bytes(ckpt_path, pickle.dumps(
                        {"weights": self.model.get_weights(), "optimizer": optimizer_values(opt),
                         "epoch": epoch, "history": history}))
                    store.write_json(store.join(store.get_logs_path(spec["run_id"]),
                                                "history.json"), history)

        user = list(spec["callbacks"] or [])
        boards = [c for c in user if isinstance(c, k.callbacks.TensorBoard)]
        user = [c for c in user if not isinstance(c, k.callbacks.TensorBoard)]
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                     hvd.callbacks.MetricAverageCallback(), *user, Checkpoint()]
        if rank == 0 and spec["checkpoint_callback"] is not None:
            callbacks.append(spec["checkpoint_callback"])
        logs_dir = None
        if rank == 0 and boards and store.saving_runs():
            # As upstream: TensorBoard writes the run's logs (rank 0 only), last among the
            # callbacks; the event files go to the store's logs path of the run after every epoch.
            logs_dir = tempfile.mkdtemp(prefix="hvd-tensorboard-")
            boards[0].log_dir = logs_dir
            callbacks += [boards[0], _sync_logs(k, logs_dir, store, store.get_logs_path(spec["run_id"]))]
        with data_module_for(spec, rank, size) as dm:
            train_gen = _batches(dm.train_data(), spec)
            val_gen = _batches(dm.val_data(), spec) if spec["val_path"] else None
            if start < spec["epochs"]:
                model.fit(train_gen, steps_per_epoch=spec["train_steps"], epochs=spec["epochs"],
                          initial_epoch=start, validation_data=val_gen,
                          validation_steps=spec["val_steps"] if val_gen is not None else None,
                          callbacks=callbacks, verbose=2 if rank == 0 and spec["verbose"] else 0)
        if logs_dir is not None:
            shutil.rmtree(logs_dir, ignore_errors=True)
        if rank != 0:
            return None
        return {"weights": model.get_weights(), "history": history}
    return train


def _variables(opt: Any) -> list[Any]:
    v = opt.variables
    return list(v() if callable(v) else v)


def optimizer_values(opt: Any) -> list[Any]:
    """The optimizer's variables (step count, learning rate, moment slots) as NumPy arrays."""
    return [np.asarray(v.numpy()) for v in _variables(opt)]


def restore_optimizer(opt: Any, model: Any, values: list[Any]) -> None:
    """Give a compiled model's optimizer the variables ``optimizer_values`` saved (it builds
    its slots first, which Keras otherwise does at the first step)."""
    from horovod.tensorflow.functions import assign_values

    if hasattr(opt, "build"):
        opt.build(model.trainable_variables)  # idempotent in Keras 3 and tf_keras
    assign_values(_variables(opt), values, f"The checkpoint holds {{want}} optimizer variables, but the "
                  f"optimizer {type(opt).__name__} has {{have}}: resume with the optimizer the run started "
                  "with, or give a new run_id.")


def _sync_logs(k: Any, local: str, store: Any, dest: str) -> Any:
    """A callback that copies a local TensorBoard log directory into the store after every epoch
    and at the end of training."""

    def sync() -> None:
        import os

        for root, _, files in os.walk(local):
            for name in files:
                path = os.path.join(root, name)
                rel = os.path.relpath(path, local).replace(os.sep, "/")
                with open(path, "rb") as f:
                    store.write_bytes(store.join(dest, rel), f.read())

    return k.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: sync(),
                                      on_train_end=lambda logs: sync())
