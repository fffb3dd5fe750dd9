"""What the gradient reducers ask of autograd: hooks on parameters' accumulated gradients, and a
callback at the end of the running backward pass (the dense reducer, ZeRO stage 2, Adasum)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import Variable

__all__ = ["GradHooks", "at_end_of_backward"]


def at_end_of_backward(callback: Callable[[], None]) -> bool:
    """Queue ``callback`` to run once autograd has finished the running backward pass (as torch's
    DistributedDataParallel reducer does); False, with nothing queued, outside a backward pass."""
    try:
        Variable._execution_engine.queue_callback(callback)
    except RuntimeError:  # not inside a backward pass
        return False
    return True


class GradHooks:
    """Post-accumulate-grad hooks put on parameters, taken off together."""

    __slots__ = ("_handles",)

    def __init__(self) -> None:
        self._handles: list[Any] = []

    def add(self, p: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
        self._handles.append(p.register_post_accumulate_grad_hook(hook))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
