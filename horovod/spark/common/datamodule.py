"""``data_module``: what reads the prepared data on each rank (upstream's ``DataModule``).

An estimator's ``data_module`` parameter takes a ``DataModule`` subclass (the class, not an
instance). Every rank constructs it with the keyword arguments below, enters it as a context
manager, and iterates ``train_data()`` / ``val_data()``: each must be an endless iterator of
batches, a batch being a dict ``{column name: numpy array with the batch on axis 0}``. The
estimators take ``train_steps_per_epoch`` / ``validation_steps_per_epoch`` batches per epoch from
them. The default, ``ParquetDataModule``, is this package's pyarrow reader.
"""

from __future__ import annotations

from typing import Any

from horovod.spark.common.reader import ParquetReader

__all__ = ["DataModule", "ParquetDataModule"]


class DataModule:
    """Base of data modules; subclasses implement ``train_data`` and ``val_data``."""

    short_name: str | None = None

    def __init__(self, train_dir: str, val_dir: str | None, num_train_epochs: int = 1,
                 has_val: bool = True, train_batch_size: int = 32, val_batch_size: int = 32,
                 shuffle: bool = True, transform_fn: Any = None, inmemory_cache_all: bool = False,
                 cur_shard: int = 0, shard_count: int = 1, schema_fields: list[str] | None = None,
                 storage_options: dict[str, Any] | None = None, steps_per_epoch_train: int = 1,
                 steps_per_epoch_val: int = 1, verbose: int = 1, store: Any = None,
                 metadata: dict[str, Any] | None = None, random_seed: int | None = None,
                 train_reader_worker_count: int = 2, val_reader_worker_count: int = 2,
                 **kwargs: Any) -> None:
        self.train_dir, self.val_dir = train_dir, val_dir
        self.num_train_epochs, self.has_val = num_train_epochs, has_val
        self.train_batch_size, self.val_batch_size = train_batch_size, val_batch_size
        self.shuffle, self.transform_fn = shuffle, transform_fn
        self.inmemory_cache_all = inmemory_cache_all
        self.cur_shard, self.shard_count = cur_shard, shard_count
        self.schema_fields = list(schema_fields or [])
        self.storage_options = storage_options
        self.steps_per_epoch_train, self.steps_per_epoch_val = steps_per_epoch_train, steps_per_epoch_val
        self.verbose, self.store, self.metadata = verbose, store, dict(metadata or {})
        self.random_seed = random_seed
        self.train_reader_worker_count = train_reader_worker_count
        self.val_reader_worker_count = val_reader_worker_count
        self.kwargs = kwargs

    def __enter__(self) -> DataModule:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def train_data(self) -> Any:
        raise NotImplementedError

    def val_data(self) -> Any:
        raise NotImplementedError


class ParquetDataModule(DataModule):
    """Reads the store's Parquet with ``ParquetReader`` (no Petastorm)."""

    short_name = "parquet"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._readers: list[ParquetReader] = []

    def _reader(self, path: str, batch_size: int, shuffle: bool, workers: int) -> ParquetReader:
        store = self.store
        reader = ParquetReader(store.fs, store.list_parquet_files(path), self.schema_fields,
                               self.metadata, batch_size, rank=self.cur_shard,
                               size=self.shard_count, shuffle=shuffle, seed=self.random_seed,
                               num_workers=workers, transformation_fn=self.transform_fn,
                               cache_in_memory=self.inmemory_cache_all)
        self._readers.append(reader)
        return reader

    def train_data(self) -> ParquetReader:
        return self._reader(self.train_dir, self.train_batch_size, self.shuffle,
                            self.train_reader_worker_count)

    def val_data(self) -> ParquetReader:
        assert self.val_dir is not None
        return self._reader(self.val_dir, self.val_batch_size, False, self.val_reader_worker_count)

    def __exit__(self, *exc: Any) -> None:
        for r in self._readers:
            r.close()
        self._readers.clear()
