"""What every rank of a Lightning ``TorchEstimator.fit`` runs (shipped to the Spark tasks)."""

from __future__ import annotations

import importlib
import io
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from horovod.spark.common.estimator import TrainingSpec

__all__ = ["make_train_fn"]


class _Loader:
    """``steps`` batches per epoch from an endless reader, as dicts of tensors."""

    def __init__(self, reader: Any, steps: int) -> None:
        self.reader, self.steps = iter(reader), steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import torch

        for _ in range(self.steps):
            batch = next(self.reader)
            out = {}
            for k, v in batch.items():
                t = torch.from_numpy(np.ascontiguousarray(v))
                out[k] = t.float() if t.dtype == torch.float64 else t
            yield out


def make_train_fn(spec: TrainingSpec) -> Callable[[], Any]:
    def train() -> dict[str, Any] | None:
        import torch

        import horovod.torch as hvd
        from horovod.lightning import HorovodStrategy
        from horovod.spark.common.estimator import data_module_for
        from horovod.spark.torch.remote import load_checkpoint, save_checkpoint
        from horovod.spark.torch.util import _module_from_bytes

        pl = importlib.import_module(spec["package"])
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        torch.set_num_threads(1)
        if spec["random_seed"] is not None:
            torch.manual_seed(spec["random_seed"])
        model = _module_from_bytes(spec["model_bytes"])
        history: dict[str, list[float]] = {}
        start = 0
        ckpt = load_checkpoint(spec)
        if ckpt is not None:
            model.load_state_dict(ckpt["model"])
            history, start = ckpt["history"], ckpt["epoch"] + 1

        class Record(pl.Callback):  # type: ignore[name-defined,misc]
            """Per-epoch metrics into the history; rank 0 checkpoints the epoch (atomically)."""

            def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
                if trainer.sanity_checking:
                    return
                epoch = start + trainer.current_epoch
                for k, v in trainer.callback_metrics.items():
                    history.setdefault(k, []).append(float(v))
                if rank == 0:
                    save_checkpoint(spec, {"model": module.state_dict(), "optimizer": None,
                                           "epoch": epoch, "history": history})

        use_gpu = spec["use_gpu"] and torch.cuda.is_available() and spec["num_gpus"] != 0
        args: dict[str, Any] = {
            "strategy": HorovodStrategy(package=spec["package"]),
            "accelerator": "gpu" if use_gpu else "cpu", "devices": 1,
            "max_epochs": spec["epochs"] - start, "logger": spec["logger"] or False,
            "log_every_n_steps": spec["log_every_n_steps"], "profiler": spec["profiler"],
            "enable_checkpointing": False, "enable_progress_bar": False,
            "enable_model_summary": False, "num_sanity_val_steps": 0,
            "use_distributed_sampler": False, "detect_anomaly": bool(spec["terminate_on_nan"]),
            "callbacks": [*list(spec["callbacks"] or []), Record()],
        }
        args.update(spec["trainer_args"])
        with data_module_for(spec, rank, size) as dm:
            train_loader = _Loader(dm.train_data(), spec["train_steps"])
            val_loader = _Loader(dm.val_data(), spec["val_steps"]) if spec["val_path"] else None
            if start < spec["epochs"]:
                trainer = pl.Trainer(**args)
                trainer.fit(model, train_dataloaders=train_loader, val_dataloaders=val_loader)
        if rank != 0:
            return None
        buf = io.BytesIO()
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, buf)
        return {"state": buf.getvalue(), "history": history}
    return train
