"""Gradient clipping by the norm of the whole gradient when each rank holds only part of it (the
``clip_grad_norm_`` of every ``GradientReducer``, ``horovod/torch/reducer.py``)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from horovod.common.process_sets import ProcessSet
from horovod.common.types import Max, Sum
from horovod.torch import mpi_ops


def clip_by_global_norm(mine: Iterable[torch.Tensor], scaled: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float, process_set: ProcessSet | None, name: str,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` where the gradients ``mine`` are this rank's part of
    the whole (disjoint across the ranks of ``process_set``; ``None``: this rank holds it all):
    the norm of the whole, combined by one allreduce, the same on every rank; every gradient of
    ``scaled`` is multiplied by ``min(1, max_norm / (norm + 1e-6))``. Returns the norm."""
    grads = [g.detach() for g in mine]
    norm_type = float(norm_type)
    dev = grads[0].device if grads else torch.device("cpu")
    if math.isinf(norm_type):
        local = max((g.abs().max().double() for g in grads if g.numel()),
                    default=torch.zeros((), dtype=torch.float64, device=dev))
        total = local if process_set is None else mpi_ops.allreduce(
            local.reshape(1), op=Max, name=f"{name}.clip.max", process_set=process_set)[0]
    else:
        local = sum((torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) ** norm_type
                     for g in grads), torch.zeros((), dtype=torch.float64, device=dev))
        if process_set is not None:
            local = mpi_ops.allreduce(local.reshape(1), op=Sum, name=f"{name}.clip.sum",
                                      process_set=process_set)[0]
        total = local ** (1.0 / norm_type)
    total = total.float()
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"{name}.clip_grad_norm_: the total norm of order {norm_type} of the "
                           "gradients is non-finite, so it cannot be clipped")
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for g in scaled:
        g.detach().mul_(coef.to(g.device, g.dtype))
    return total
