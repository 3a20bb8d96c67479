"""``train_op``: what applies one update, run by the Estimator after ``model_fn`` returns.

TF's ``optimizer.minimize(loss, global_step)`` built an op that the session ran; here it builds a
`TrainOp` that the Estimator runs: ``backward``, then the gradients averaged over the replicas,
then the optimizer's step. Averaging is TF's Estimator semantics (the optimizer scaled each
replica's loss by ``1/replicas`` and summed gradients): with the seed's loss, the sum over this
replica's batch divided by the per-replica ``BATCH_SIZE``, N workers train exactly as one process
on the global batch of ``N * BATCH_SIZE`` with loss ``sum / (N * BATCH_SIZE)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from meshfit._protocols import DistributionStrategy
from meshfit._validation import invalid_argument
from meshfit.distribute import mark_reduced
from meshfit.optimizers import Optimizer


class TrainOp:
    """A deferred update: ``backward`` of ``loss``, gradient averaging, optimizer step.

    Args:
        optimizer: a meshfit optimizer (built on the model's parameters when first run) or a
            ``torch.optim.Optimizer``.
        loss: the scalar loss tensor.
        var_list: the parameters to train (default: every trainable parameter of the modules
            ``model_fn`` uses).
    """

    def __init__(self, optimizer: Any, loss: torch.Tensor, var_list: Iterable[torch.Tensor] | None = None) -> None:
        if not (hasattr(optimizer, "step") and hasattr(optimizer, "zero_grad")):
            raise invalid_argument("optimizer", "a meshfit optimizer or a torch.optim.Optimizer", optimizer, TypeError)
        if not isinstance(loss, torch.Tensor):
            raise invalid_argument("loss", "a scalar tensor", loss, TypeError)
        self.optimizer, self.loss = optimizer, loss
        self.var_list = list(var_list) if var_list is not None else None

    def __repr__(self) -> str:
        return f"TrainOp(optimizer={type(self.optimizer).__name__})"


def minimize(optimizer: Any, loss: torch.Tensor, global_step: Any = None,
             var_list: Iterable[torch.Tensor] | None = None) -> TrainOp:
    """TF1's ``optimizer.minimize(loss, global_step)`` for any optimizer: a `TrainOp`.

    ``global_step`` is accepted for TF compatibility: the Estimator counts steps itself.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> minimize(torch.optim.SGD([w], lr=0.1), (w * 2).sum())
        TrainOp(optimizer=SGD)
    """
    return TrainOp(optimizer, loss, var_list)


def optimizer_of(train_op: Any) -> Any:
    """The optimizer a ``train_op`` applies (None when there is none)."""
    if train_op is None:
        return None
    if isinstance(train_op, TrainOp):
        return train_op.optimizer
    if hasattr(train_op, "step") and hasattr(train_op, "zero_grad"):
        return train_op
    raise TypeError(f"Invalid `train_op`: expected optimizer.minimize(loss, global_step), mf.estimator.minimize("
                    f"optimizer, loss) or an optimizer, received {type(train_op).__name__}.")


def trained_parameters(optimizer: Any, default: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters ``optimizer`` updates (building a meshfit optimizer on ``default`` first)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [p for group in optimizer.param_groups for p in group["params"]]
    if isinstance(optimizer, Optimizer):
        if not optimizer.built:
            optimizer.build([p for p in default if p.requires_grad])
        optimizer = optimizer.torch_optimizer
    return [p for group in optimizer.param_groups for p in group["params"]]  # any optimizer with param_groups


def run_train_op(train_op: Any, loss: torch.Tensor, params: list[torch.Tensor], strategy: DistributionStrategy,
                 reduce: bool = True) -> None:
    """Apply ``train_op``: backward, average the gradients of ``params`` over replicas (unless the
    backward did, ``reduce=False``: fully sharded modules), step."""
    optimizer = optimizer_of(train_op)
    if isinstance(train_op, TrainOp):
        loss = train_op.loss
    if loss.grad_fn is None:
        raise ValueError("Invalid `loss`: it does not depend on any trainable parameter (no gradient); compute it "
                         "from the module's output in model_fn.")
    optimizer.zero_grad(set_to_none=True)  # a parameter the loss does not use keeps no gradient (not zeros)
    loss.backward()
    if reduce:
        average_gradients(params, strategy)
    mark_reduced(params)  # no optimizer sums them again
    optimizer.step()


def average_gradients(params: list[torch.Tensor], strategy: DistributionStrategy) -> None:
    """Replace each gradient by its mean over the replicas (one flat all-reduce per dtype).

    A parameter without a gradient on some replicas counts as zero there; one without a gradient
    on every replica keeps none, so the optimizer leaves it alone, as in one process.
    """
    replicas = strategy.num_replicas_in_sync
    if replicas == 1:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault((p.dtype, p.device), []).append(p)
    for (dtype, device), group in groups.items():
        present = torch.tensor([float(p.grad is not None) for p in group], dtype=dtype, device=device)
        flat = torch.cat([*(p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=dtype,
                                                                                      device=device) for p in group),
                          present])
        strategy.all_reduce_sum(flat)
        counts = flat[-len(group):].tolist()
        flat = flat[:-len(group)].div_(replicas)
        offset = 0
        for p, count in zip(group, counts, strict=True):
            value = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            if count == 0:
                p.grad = None
            elif p.grad is None:
                p.grad = value.clone()
            else:
                p.grad.copy_(value)

