"""What the ranks of an estimator's fit get and build: the ``TrainingSpec`` and the rank's
``DataModule``.

The ranks unpickle their training function, whose spec and helpers come from here and from the
framework's ``remote`` module: none of them imports PySpark, which the ranks do not use (the Spark
ML classes of ``horovod.spark.common.estimator`` cost every rank of every fit most of a second to
import)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["TrainingSpec", "data_module_for", "estimator_attrs"]


class TrainingSpec(dict):
    """What every rank needs to train: data paths, metadata, steps, and the estimator's params."""


def data_module_for(spec: TrainingSpec, rank: int, size: int) -> Any:
    """The rank's ``DataModule`` instance for ``spec`` (the default reads with pyarrow)."""
    from horovod.spark.common.datamodule import DataModule, ParquetDataModule

    cls = spec["data_module"] or ParquetDataModule
    if not (isinstance(cls, type) and issubclass(cls, DataModule)):
        raise TypeError(f"data_module={cls!r}: give a DataModule subclass (the class itself), "
                        "e.g. horovod.spark.common.datamodule.ParquetDataModule.")
    columns = spec["feature_cols"] + spec["label_cols"]
    if spec["sample_weight_col"]:
        columns.append(spec["sample_weight_col"])
    return cls(train_dir=spec["train_path"], val_dir=spec["val_path"],
               num_train_epochs=spec["epochs"], has_val=spec["val_path"] is not None,
               train_batch_size=spec["batch_size"], val_batch_size=spec["val_batch_size"],
               shuffle=spec["shuffle"], transform_fn=spec["transformation_fn"],
               inmemory_cache_all=spec["inmemory_cache_all"], cur_shard=rank, shard_count=size,
               schema_fields=list(dict.fromkeys(columns)), store=spec["store"],
               steps_per_epoch_train=spec["train_steps"], steps_per_epoch_val=spec["val_steps"],
               verbose=spec["verbose"], metadata=spec["metadata"], random_seed=spec["random_seed"],
               train_reader_worker_count=spec["train_reader_num_workers"],
               val_reader_worker_count=spec["val_reader_num_workers"])


def estimator_attrs(package: str, module: str, names: Sequence[str],
                    aliases: Mapping[str, str] | None = None) -> Callable[[str], Any]:
    """A framework package's module ``__getattr__`` (PEP 562): its estimator classes ``names``,
    loaded from ``module`` on first use (``aliases``: a package name -> the class's name there).

    The ranks of a fit import only the package's ``remote`` module, and so never the estimator's
    Spark ML classes (PySpark)."""
    known = {name: (aliases or {}).get(name, name) for name in names}

    def __getattr__(name: str) -> Any:
        if name in known:
            value = getattr(importlib.import_module(module), known[name])
            setattr(sys.modules[package], name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__
