"""``ElasticSampler``: splits a dataset among the current ranks and, after a reset, among the new
ones, skipping the samples already processed in the current epoch."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch.utils.data

from horovod.common.basics import rank, size

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler):
    """Like ``DistributedSampler``, but re-partitions the rest of the epoch after a reset.

    Keep it in the ``TorchState``, call ``record_batch(batch_idx, batch_size)`` after each batch
    and ``set_epoch(epoch)`` at the *end* of each epoch.

    Args:
        dataset: the dataset (its length must not change).
        shuffle: shuffle the indices, the same way on every rank (seed + epoch).
        seed: the shuffle seed, identical on every rank.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` with nothing processed (call it at the end of the previous epoch)."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count a batch of ``batch_size`` samples processed on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Re-read the job's size and rank and re-partition what is left of the epoch."""
        try:
            self.num_replicas, self.rank = size(), rank()
        except ValueError:  # not initialized: a job of one
            self.num_replicas, self.rank = 1, 0
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = list(self.remaining_indices)
        if indices:
            while len(indices) < self.total_size:
                indices += indices[:self.total_size - len(indices)]
        self.indices = indices[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
