"""`SyncBatchNorm`: batch normalization over the global batch, on any backend (gloo included).

Keras's ``BatchNormalization(synchronized=True)``. torch's ``nn.SyncBatchNorm`` runs on GPUs only;
this one computes the batch statistics with ``torch.distributed.nn.functional.all_reduce``, whose
backward all-reduces the gradients, so it trains on CPU workers (gloo) as on GPUs, through DDP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from meshfit.distribute import current_world


def _group(process_group: Any) -> Any:
    """``process_group``, or the data group of this job's `World` (None with one process)."""
    if process_group is not None:
        return process_group
    return current_world().data_group()


class SyncBatchNorm(_BatchNorm):
    """Batch normalization whose training statistics are those of the global batch (all replicas).

    Arguments as ``torch.nn.BatchNorm1d/2d/3d`` (any input of shape ``(N, C, ...)``), plus
    ``process_group`` (default: the data-parallel replicas of this job's `World`: every process of a
    1-D job, the ``batch`` axis of a mesh). In eval mode, or without a process group of more than one
    process, it is plain batch normalization. Each training forward makes two
    all-reduces (mean, then variance); every replica must run it the same number of times.

    Example:
        >>> import torch
        >>> from meshfit.nn import SyncBatchNorm
        >>> norm = SyncBatchNorm(3)
        >>> norm(torch.randn(8, 3)).shape
        torch.Size([8, 3])
        >>> model = SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(4)))
        >>> type(model[0]).__name__
        'SyncBatchNorm'
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Any = None, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"Invalid input to SyncBatchNorm: expected a tensor of shape (N, C, ...), received "
                             f"one of shape {tuple(input.shape)}.")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        group = _group(self.process_group) if self.training else None
        if group is None or dist.get_world_size(group) == 1:
            return super().forward(input)
        from torch.distributed.nn.functional import all_reduce  # autograd-aware collectives

        dims = [0, *range(2, input.dim())]
        count = torch.tensor(float(input.numel() // input.shape[1]), dtype=input.dtype, device=input.device)
        sums = torch.cat([input.sum(dims), count.reshape(1)])
        sums = all_reduce(sums, group=group)
        total = sums[-1]
        mean = sums[:-1] / total
        shape = [1, -1] + [1] * (input.dim() - 2)
        centered = input - mean.reshape(shape)
        squares = (centered * centered).sum(dims)
        squares = all_reduce(squares, group=group)
        var = squares / total
        if self.track_running_stats and self.running_mean is not None:
            self._update_running_stats(mean.detach(), var.detach(), float(total.detach()))
        out = centered * torch.rsqrt(var + self.eps).reshape(shape)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out

    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: float) -> None:
        tracked, running_mean, running_var = self.num_batches_tracked, self.running_mean, self.running_var
        if tracked is None or running_mean is None or running_var is None:
            return  # track_running_stats=False: nothing to update
        with torch.no_grad():
            tracked.add_(1)
            factor = 1.0 / float(tracked) if self.momentum is None else self.momentum
            unbiased = var * (count / max(count - 1.0, 1.0))
            running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
            running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: Any = None) -> nn.Module:
        """``module`` with every ``BatchNorm*d`` replaced by a `SyncBatchNorm` holding its weights and statistics."""
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group)
            with torch.no_grad():
                if module.affine:
                    converted.weight, converted.bias = module.weight, module.bias
                if module.track_running_stats:
                    converted.running_mean, converted.running_var = module.running_mean, module.running_var
                    converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted
