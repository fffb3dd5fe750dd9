"""``SyncBatchNorm``: batch normalization with statistics over the whole global batch.

In training mode every rank contributes the count, sum and sum of squares of its part of the
batch (one allreduce), so ranks may hold different batch sizes; the backward pass allreduces the
two gradient sums the input gradient needs. Weight and bias gradients stay local, as for
``torch.nn.SyncBatchNorm``: ``DistributedOptimizer`` averages them like every other gradient.

Unlike upstream Horovod (GPU only), this version runs on CPU tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from horovod.common.basics import size
from horovod.common.types import Sum
from horovod.torch.mpi_ops import allreduce_async, synchronize

__all__ = ["SyncBatchNorm"]


def _sum_all(t: torch.Tensor, name: str) -> torch.Tensor:
    return synchronize(allreduce_async(t, name=name, op=Sum))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float,
                momentum: float) -> torch.Tensor:
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        xd = x.detach().to(torch.float64)
        count = torch.tensor([x.numel() / c], dtype=torch.float64, device=x.device)
        # One allreduce of [count, sum(x), sum(x^2)] per channel, in float64 against cancellation.
        stats = torch.cat([count, xd.sum(dims), (xd * xd).sum(dims)])
        stats = _sum_all(stats, f"sync_batch_norm.{c}.stats")
        n = stats[0]
        mean = stats[1:1 + c] / n
        var = (stats[1 + c:] / n - mean * mean).clamp_min(0)
        if running_mean is not None and running_var is not None:
            unbiased = var * (n / (n - 1)) if n > 1 else var
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = [1, c] + [1] * (x.dim() - 2)
        invstd = (var + eps).rsqrt()
        xhat = (xd - mean.view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.detach().to(torch.float64).view(shape)
        if bias is not None:
            y = y + bias.detach().to(torch.float64).view(shape)
        ctx.save_for_backward(xhat.to(x.dtype), invstd, weight)
        ctx.n = n
        ctx.has_bias = bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        xhat, invstd, weight = ctx.saved_tensors
        c = xhat.shape[1]
        dims = [0] + list(range(2, xhat.dim()))
        shape = [1, c] + [1] * (xhat.dim() - 2)
        g = grad_out.to(torch.float64)
        xh = xhat.to(torch.float64)
        local_dy = g.sum(dims)
        local_dy_xhat = (g * xh).sum(dims)
        sums = _sum_all(torch.cat([local_dy, local_dy_xhat]), f"sync_batch_norm.{c}.grad")
        mean_dy = (sums[:c] / ctx.n).view(shape)
        mean_dy_xhat = (sums[c:] / ctx.n).view(shape)
        scale = invstd.view(shape)
        if weight is not None:
            scale = scale * weight.detach().to(torch.float64).view(shape)
        grad_in = ((g - mean_dy - xh * mean_dy_xhat) * scale).to(grad_out.dtype)
        grad_w = local_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = local_dy.to(grad_out.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_in, grad_w, grad_b, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization whose training statistics cover the batches of all ranks.

    Every rank must call forward (and backward) the same number of times, in the same order of
    layers. With one process, or in eval mode with running statistics, it is plain batch norm.

    Raises:
        ValueError: the input has fewer than 2 dimensions.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True,
                 track_running_stats: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        momentum = self.momentum
        if self.momentum is None:  # cumulative moving average
            momentum = 1.0 / float(self.num_batches_tracked) if self.num_batches_tracked else 0.0
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats or size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                use_batch_stats, momentum if momentum is not None else 0.0, self.eps)
        running_mean = self.running_mean if self.training else None
        running_var = self.running_var if self.training else None
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean, running_var,
                                            self.eps, float(momentum or 0.0))
