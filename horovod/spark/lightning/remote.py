"""What every rank of a Lightning ``TorchEstimator.fit`` runs (shipped to the Spark tasks)."""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

# upstream's module constants, imported from here by user code
from horovod.spark.common.constants import (  # noqa: F401
    BYTES_PER_GIB,
    CUSTOM_SPARSE,
    METRIC_PRINT_FREQUENCY,
    TOTAL_BUFFER_MEMORY_CAP_GIB,
)
from horovod.spark.common.training import TrainingSpec

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
        from horovod.lightning import strategy_class
        from horovod.spark.common.training import data_module_for
        from horovod.spark.torch.remote import load_checkpoint, save_checkpoint, trained_result
        from horovod.spark.torch.util import _module_from_bytes

        pl = importlib.import_module(spec["package"])
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        torch.set_num_threads(1)
        if spec["random_seed"] is not None:
            torch.manual_seed(spec["random_seed"])
        model = _module_from_bytes(spec["model_bytes"])
        history: dict[str, list[float]] = {}
        start = offset = 0
        resume_from = None  # Lightning's own checkpoint of the last epoch, as a local file
        scratch = tempfile.mkdtemp(prefix="hvd-lightning-")
        ckpt = load_checkpoint(spec)
        if ckpt is not None:
            history, start = ckpt["history"], ckpt["epoch"] + 1
            if ckpt.get("lightning") is not None:
                # weights, optimizer states, LR schedulers, epoch and step: Lightning restores them
                resume_from = os.path.join(scratch, "resume.ckpt")
                with open(resume_from, "wb") as f:
                    f.write(ckpt["lightning"])
            else:  # a checkpoint of weights only
                model.load_state_dict(ckpt["model"])
                offset = start

        class Record(pl.Callback):  # type: ignore[name-defined,misc]
            """Per-epoch metrics into the history; rank 0 checkpoints the epoch (atomically):
            the weights, and Lightning's full checkpoint for resuming (optimizer states too)."""

            def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
                if trainer.sanity_checking:
                    return
                epoch = offset + trainer.current_epoch
                for k, v in trainer.callback_metrics.items():
                    history.setdefault(k, []).append(float(v))
                path = os.path.join(scratch, "epoch.ckpt")
                trainer.save_checkpoint(path)  # every rank: it ends with a barrier
                if rank == 0:
                    with open(path, "rb") as f:
                        full = f.read()
                    save_checkpoint(spec, {"model": module.state_dict(), "optimizer": None,
                                           "lightning": full, "epoch": epoch, "history": history})

        use_gpu = spec["use_gpu"] and torch.cuda.is_available() and spec["num_gpus"] != 0
        args: dict[str, Any] = {
            "strategy": strategy_class(spec["package"])(),
            "accelerator": "gpu" if use_gpu else "cpu", "devices": 1,
            "max_epochs": spec["epochs"] - offset, "logger": spec["logger"] or False,
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
                trainer.fit(model, train_dataloaders=train_loader, val_dataloaders=val_loader,
                            ckpt_path=resume_from)
        shutil.rmtree(scratch, ignore_errors=True)
        return trained_result(model, history) if rank == 0 else None
    return train
