"""The reference of an elastic job that claims to average: the same training in one process.

``averaged_params(step_sizes, batch, lr)`` starts from ``torch.manual_seed(0)``'s
``Linear(4, 1)`` (rank 0's weights, which the job broadcasts) and takes one SGD step per entry of
``step_sizes``: the gradients of ranks ``0..n-1`` on ``batch(step, rank)``, summed in rank order
and divided by ``n``. A job whose ranks each train on their own batch matches it only if every
step averaged every rank's gradient once (none lost, applied twice or left unaveraged across a
reset).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["averaged_params"]


def averaged_params(step_sizes: Sequence[int], batch: Callable[[int, int], tuple[Any, Any]],
                    lr: float) -> list[Any]:
    """The parameters (NumPy arrays, in ``model.parameters()`` order) after the steps."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step, n in enumerate(step_sizes):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(n):
            x, y = batch(step, rank)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            for t, p in zip(total, model.parameters()):
                t += p.grad
        for t, p in zip(total, model.parameters()):
            p.grad = t / n
        opt.step()
    return [p.detach().numpy() for p in model.parameters()]
