"""Helpers shared by the Keras estimator, its model and the ranks' training code."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np

__all__ = ["keras_flavour", "keras_module", "model_to_bytes", "model_from_bytes", "input_shapes_of", "TF_KERAS"]

TF_KERAS = "tf_keras"  # upstream's name of the Keras flavour bundled with TensorFlow


def keras_flavour(model: Any) -> str:
    """``"tf_keras"`` for a Keras 2 (``tf_keras``) model, else ``"keras"``."""
    return "tf_keras" if type(model).__module__.startswith("tf_keras") or any(
        c.__module__.startswith("tf_keras") for c in type(model).__mro__) else "keras"


def keras_module(flavour: str) -> Any:
    if flavour == "tf_keras":
        import tf_keras

        return tf_keras
    import keras

    return keras


def model_to_bytes(model: Any) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def model_from_bytes(data: bytes, flavour: str, custom_objects: dict[str, Any] | None = None,
                     compile: bool = False) -> Any:
    k = keras_module(flavour)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.keras")
        with open(path, "wb") as f:
            f.write(data)
        return k.models.load_model(path, custom_objects=custom_objects, compile=compile)


def input_shapes_of(model: Any) -> list[list[int]] | None:
    try:
        return [[int(d) if d is not None else -1 for d in t.shape] for t in model.inputs]
    except (AttributeError, ValueError, TypeError):
        return None  # a subclassed model that was never built: no shapes to check


def _shaped(x: np.ndarray, shape: list[int] | None) -> np.ndarray:
    if x.dtype == np.float64:
        x = x.astype(np.float32)
    if shape is not None and len(shape) > 1 and x.ndim >= 1:
        x = x.reshape([len(x), *[d for d in shape[1:]]])
    elif x.ndim == 1:
        x = x.reshape(-1, 1)
    return x
