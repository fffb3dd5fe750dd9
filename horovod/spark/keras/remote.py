"""What every rank of a ``KerasEstimator.fit`` runs (shipped to the Spark tasks)."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from horovod.spark.common.estimator import TrainingSpec

__all__ = ["make_train_fn"]


def _batches(reader: Any, spec: TrainingSpec, with_weights: bool) -> Iterator[tuple[Any, ...]]:
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
        if with_weights and spec["sample_weight_col"]:
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
        from horovod.spark.common.estimator import data_module_for
        from horovod.spark.keras.util import keras_module, model_from_bytes

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        if spec["random_seed"] is not None:
            tf.random.set_seed(spec["random_seed"])
        k = keras_module(spec["flavour"])
        store, ckpt_path = spec["store"], spec["checkpoint_path"]
        model = model_from_bytes(spec["model_bytes"], spec["flavour"], spec["custom_objects"])
        history: dict[str, list[float]] = {}
        start = 0
        if store.exists(ckpt_path):
            ckpt = pickle.loads(store.read_bytes(ckpt_path))
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

        class Checkpoint(k.callbacks.Callback):
            """Rank 0 writes the weights, epoch and history after every epoch (atomically)."""

            def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
                for key, v in (logs or {}).items():
                    history.setdefault(key, []).append(float(v))
                if rank == 0:
                    store.write_bytes(ckpt_path, pickle.dumps(
                        {"weights": self.model.get_weights(), "epoch": epoch, "history": history}))
                    store.write_json(store.join(store.get_logs_path(spec["run_id"]),
                                                "history.json"), history)

        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                     hvd.callbacks.MetricAverageCallback(), *list(spec["callbacks"] or []),
                     Checkpoint()]
        if rank == 0 and spec["checkpoint_callback"] is not None:
            callbacks.append(spec["checkpoint_callback"])
        with data_module_for(spec, rank, size) as dm:
            train_gen = _batches(dm.train_data(), spec, True)
            val_gen = _batches(dm.val_data(), spec, False) if spec["val_path"] else None
            if start < spec["epochs"]:
                model.fit(train_gen, steps_per_epoch=spec["train_steps"], epochs=spec["epochs"],
                          initial_epoch=start, validation_data=val_gen,
                          validation_steps=spec["val_steps"] if val_gen is not None else None,
                          callbacks=callbacks, verbose=2 if rank == 0 and spec["verbose"] else 0)
        if rank != 0:
            return None
        return {"weights": model.get_weights(), "history": history}
    return train
