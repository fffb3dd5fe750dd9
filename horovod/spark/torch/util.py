"""Helpers shared by the Torch estimators, their models and the ranks' training code."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from horovod.spark.common.util import check_feature_shapes

__all__ = ["check_input_shapes", "is_module_available", "is_module_available_fn", "serialize_fn",
           "deserialize_fn", "save_into_bio", "save_into_bio_fn"]


# -- upstream's helpers: each *_fn returns a function that ships to the executors by value ------
def is_module_available_fn() -> Any:
    def _is_module_available(module_name: str) -> bool:
        import importlib.util

        return importlib.util.find_spec(module_name) is not None
    return _is_module_available


def is_module_available(module_name: str) -> bool:
    """Whether ``module_name`` can be imported here (without importing it)."""
    return is_module_available_fn()(module_name)


def serialize_fn() -> Any:
    def _serialize(obj: Any) -> str:
        """``obj`` (a model, an optimizer, a function) as base64 text of its cloudpickle."""
        import base64

        import cloudpickle

        return base64.b64encode(cloudpickle.dumps(obj)).decode("ascii")
    return _serialize


def deserialize_fn() -> Any:
    def _deserialize(data: str | bytes) -> Any:
        """The object ``serialize_fn()`` encoded (loading runs pickled code: trusted data only)."""
        import base64
        import pickle

        return pickle.loads(base64.b64decode(data))
    return _deserialize


def save_into_bio_fn() -> Any:
    def _save_into_bio(obj: Any, save_obj_fn: Any) -> io.BytesIO:
        """``save_obj_fn(obj, buffer)`` into a new ``BytesIO``, rewound."""
        import io as _io

        bio = _io.BytesIO()
        save_obj_fn(obj, bio)
        bio.seek(0)
        return bio
    return _save_into_bio


def save_into_bio(obj: Any, save_obj_fn: Any) -> io.BytesIO:
    return save_into_bio_fn()(obj, save_obj_fn)


def _module_bytes(module: Any) -> bytes:
    import cloudpickle
    import torch

    buf = io.BytesIO()
    torch.save(module, buf, pickle_module=cloudpickle)
    return buf.getvalue()


def _module_from_bytes(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


class ModuleParams:
    """Estimator or model params whose ``model`` is a ``torch.nn.Module``: saved as the bytes
    ``torch.save`` writes, loaded back with ``torch.load``; a ``Backend`` is never saved."""

    @classmethod
    def _params_to_bytes(cls, values: dict[str, Any]) -> dict[str, Any]:
        out = dict(values)
        if out.get("model") is not None:
            out["model"] = _module_bytes(out["model"])
        out.pop("backend", None)
        return out

    @classmethod
    def _params_from_bytes(cls, values: dict[str, Any]) -> dict[str, Any]:
        out = dict(values)
        if isinstance(out.get("model"), bytes):
            out["model"] = _module_from_bytes(out["model"])
        return out


def check_input_shapes(metadata: dict[str, Any], feature_cols: list[str],
                       input_shapes: list[list[int]] | None) -> None:
    """Each feature's element count matches its ``input_shapes`` entry (before training)."""
    if input_shapes is not None:
        check_feature_shapes(metadata, feature_cols, input_shapes, "input_shapes")


def _to_tensor(x: np.ndarray, shape: list[int] | None = None) -> Any:
    import torch

    t = torch.from_numpy(np.ascontiguousarray(x))
    if t.dtype == torch.float64:
        t = t.float()
    if shape is not None:
        t = t.reshape([-1 if d is None else d for d in shape])
    elif t.dim() == 1:
        t = t.reshape(-1, 1)
    return t
