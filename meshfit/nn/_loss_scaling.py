"""Scale per-replica losses so that the gradients summed across replicas are the global batch's.

meshfit optimizers *sum* replicas' gradients in custom loops (TensorFlow's semantics), so each
replica divides its per-example losses by the **global** batch size, not by its own batch.
"""

from __future__ import annotations

from typing import Any

import torch

from meshfit.distribute import get_strategy


def _num_replicas() -> int:
    return get_strategy().num_replicas_in_sync


def compute_average_loss(per_example_loss: torch.Tensor, global_batch_size: int | None = None,
                         sample_weight: Any = None) -> torch.Tensor:
    """The sum of the per-example losses divided by the global batch size, as ``tf.nn.compute_average_loss``.

    Args:
        per_example_loss: this replica's per-example losses, shape ``(batch, ...)`` (e.g. a loss
            with ``reduction="none"``); all elements are summed.
        global_batch_size: the batch size summed over all replicas. Default: this replica's batch
            times ``num_replicas_in_sync`` of the current strategy (inside ``strategy.run`` or
            ``strategy.scope()``).
        sample_weight: a scalar or per-example weights multiplied in first.

    Returns:
        A scalar tensor. Summed over replicas it is the mean loss over the global batch.

    Raises:
        ValueError: if ``global_batch_size`` is not a positive int.

    Example:
        >>> compute_average_loss(torch.tensor([1.0, 2.0, 3.0]), global_batch_size=6)
        tensor(1.)
    """
    loss = torch.as_tensor(per_example_loss)
    if sample_weight is not None:
        weight = torch.as_tensor(sample_weight, dtype=loss.dtype, device=loss.device)
        while weight.dim() < loss.dim():
            weight = weight.unsqueeze(-1)
        loss = loss * weight
    if global_batch_size is None:
        per_replica = loss.shape[0] if loss.dim() > 0 else 1
        global_batch_size = per_replica * _num_replicas()
    elif isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size <= 0:
        raise ValueError("Invalid `global_batch_size`: expected a positive int, received "
                         f"global_batch_size={global_batch_size!r}.")
    if global_batch_size == 0:  # an empty per-replica batch and no global size given
        return loss.sum() * 0.0
    return loss.sum() / global_batch_size


def scale_regularization_loss(regularization_loss: Any) -> torch.Tensor:
    """A regularisation loss divided by ``num_replicas_in_sync``, as ``tf.nn.scale_regularization_loss``.

    Every replica adds the same penalty; summed across replicas it then counts once.

    Args:
        regularization_loss: a scalar, or a list of scalars that are summed.

    Returns:
        A scalar tensor.

    Example:
        >>> scale_regularization_loss([torch.tensor(1.0), torch.tensor(3.0)])
        tensor(4.)
    """
    if isinstance(regularization_loss, (list, tuple)):
        regularization_loss = torch.stack([torch.as_tensor(v) for v in regularization_loss]).sum()
    return torch.as_tensor(regularization_loss).sum() / _num_replicas()
