"""Argument rules of the distributed optimizers and tapes, shared by every binding (no framework)."""

from __future__ import annotations

from typing import Any

from horovod.common.types import ReduceOp

__all__ = ["check_op_args", "normalize_groups"]


def check_op_args(op: int, gradient_predivide_factor: float, average_aggregated_gradients: bool = False,
                  keras: bool = False) -> ReduceOp:
    """Validate the reduction arguments of the distributed optimizers and tapes.

    Raises:
        ValueError: predivide with an op other than Average; Adasum with Keras or with
            ``average_aggregated_gradients``; an op other than Average/Sum for Keras.
    """
    op = ReduceOp(int(op))
    if gradient_predivide_factor != 1.0 and op != ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if op == ReduceOp.ADASUM:
        if keras:
            raise ValueError("op == Adasum is not supported yet with Keras")
        if average_aggregated_gradients:
            raise ValueError("Adasum does not support average_aggregated_gradients == True")
    if keras and op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError("op currently only supports Average and Sum")
    return op


def normalize_groups(num_groups: int, groups: Any) -> Any:
    """Apply upstream's rules: ``num_groups`` is deprecated in favour of ``groups``.

    Raises:
        ValueError: ``groups`` is neither a positive int nor a list of lists of variables.
    """
    if num_groups != 0:
        import warnings

        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v1.0.",
                      DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    if groups is None:
        return None
    if isinstance(groups, int):
        if groups <= 0:
            raise ValueError("groups must be a positive integer or a list of lists of tf.Variable.")
        return groups
    if isinstance(groups, list | tuple) and all(isinstance(g, list | tuple) for g in groups):
        return [list(g) for g in groups]
    raise ValueError("groups should be a non-negative integer or a list of lists of tf.Variable.")
