"""Upstream's ``horovod.spark.lightning.util``: the same helpers as ``horovod.spark.torch.util``."""

from horovod.spark.torch.util import (
    deserialize_fn,
    is_module_available,
    is_module_available_fn,
    save_into_bio,
    save_into_bio_fn,
    serialize_fn,
)

__all__ = ["is_module_available", "is_module_available_fn", "serialize_fn", "deserialize_fn",
           "save_into_bio", "save_into_bio_fn"]
