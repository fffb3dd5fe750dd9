"""References of jobs that claim to average gradients: the same training in one process.

``averaged_steps(model, optimizer, loss_of, steps)`` takes one optimizer step per entry of
``steps`` (the ranks' batches of that step, in rank order): the gradients of ``loss_of(model,
batch)`` for every rank's batch, summed in rank order and divided by the number of ranks, as
Horovod's average does. A job whose ranks each train on their own batch matches it only if every
step averaged every rank's gradient once (none lost, summed, applied twice or left unaveraged).

``averaged_params(step_sizes, batch, lr)`` is that reference for the elastic jobs' model:
``torch.manual_seed(0)``'s ``Linear(4, 1)`` (rank 0's weights, which the job broadcasts), SGD, the
MSE of ``batch(step, rank)``, ``step_sizes[step]`` ranks at each step (a reset changes it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["averaged_params", "averaged_steps"]


def averaged_steps(model: Any, optimizer: Any, loss_of: Callable[[Any, Any], Any],
                   steps: Sequence[Sequence[Any]]) -> Any:
    """Train ``model`` in place with ``optimizer`` on the averaged gradients; returns it."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    for batches in steps:
        total = [torch.zeros_like(p) for p in params]
        for batch in batches:
            optimizer.zero_grad()
            loss_of(model, batch).backward()
            for t, p in zip(total, params):
                if p.grad is not None:
                    t += p.grad
        for t, p in zip(total, params):
            p.grad = t / len(batches)
        optimizer.step()
    return model


def averaged_params(step_sizes: Sequence[int], batch: Callable[[int, int], tuple[Any, Any]],
                    lr: float) -> list[Any]:
    """The parameters (NumPy arrays, in ``model.parameters()`` order) after the steps."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def mse(m: Any, xy: tuple[Any, Any]) -> Any:
        return torch.nn.functional.mse_loss(m(xy[0]), xy[1])

    averaged_steps(model, opt, mse,
                   [[batch(step, r) for r in range(n)] for step, n in enumerate(step_sizes)])
    return [p.detach().numpy() for p in model.parameters()]
