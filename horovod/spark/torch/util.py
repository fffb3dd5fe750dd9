"""Helpers shared by the Torch estimators, their models and the ranks' training code."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from horovod.spark.common.util import DataPreparationError

__all__ = ["check_input_shapes"]


def _module_bytes(module: Any) -> bytes:
    import cloudpickle
    import torch

    buf = io.BytesIO()
    torch.save(module, buf, pickle_module=cloudpickle)
    return buf.getvalue()


def _module_from_bytes(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def check_input_shapes(metadata: dict[str, Any], feature_cols: list[str],
                       input_shapes: list[list[int]] | None) -> None:
    """Each feature's element count matches its ``input_shapes`` entry (before training)."""
    if input_shapes is None:
        return
    if len(input_shapes) != len(feature_cols):
        raise DataPreparationError(f"input_shapes has {len(input_shapes)} shape(s) for "
                                   f"{len(feature_cols)} feature column(s) {feature_cols}.")
    for col, shape in zip(feature_cols, input_shapes):
        have = int(np.prod(metadata[col]["shape"])) if metadata[col]["shape"] else 1
        want = int(np.prod([d for d in shape if d not in (-1, None)]))
        if want != have:
            raise DataPreparationError(
                f"Feature column {col!r} has {have} value(s) per row, but input_shapes gives it "
                f"shape {list(shape)} ({want} values per row). Fix input_shapes or the column.")


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
