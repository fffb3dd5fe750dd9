"""Small TensorFlow helpers that upstream Horovod keeps in ``horovod.tensorflow.util``."""

from __future__ import annotations

import tensorflow as tf

__all__ = ["_executing_eagerly"]


def _executing_eagerly() -> bool:
    """True when ops run eagerly now (False while tracing a ``tf.function`` or in a TF1 graph)."""
    return bool(tf.executing_eagerly())
