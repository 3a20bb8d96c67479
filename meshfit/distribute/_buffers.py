"""Module buffers (batch-norm running statistics) made the same on every replica: rank 0's.

``DistributedDataParallel`` copies rank 0's buffers to every replica before each training forward
and never after the last one, so after a step each replica holds running statistics updated with
its own share of the batch. Training only ever reads rank 0's (the next forward overwrites the
others'), so giving every replica rank 0's buffers changes nothing in training and makes what is
read afterwards agree: ``get_weights``, ``evaluate``, ``predict``, ``save`` and checkpoints.

meshfit agrees them (rank 0's, DDP's authority; TensorFlow reads the mean over replicas instead)
at the end of each epoch (before validation), before every checkpoint save and at the end of
``fit``. Plain tensors only: a DTensor buffer keeps its own layout.
"""

from __future__ import annotations

import torch
from torch.nn.parameter import is_lazy

from meshfit._lazy_dtensor import is_dtensor
from meshfit._protocols import DistributionStrategy


def agree_buffers(module: torch.nn.Module, strategy: DistributionStrategy) -> None:
    """Give every replica rank 0's values of ``module``'s buffers, in place (collective).

    Every replica of ``strategy`` must call it at the same point; it does nothing for one replica.
    """
    if strategy.num_replicas_in_sync <= 1:
        return
    buffers = [b for b in module.buffers() if not is_lazy(b) and not is_dtensor(b) and b.numel()]
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for buffer in buffers:
        groups.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    with torch.no_grad():
        for (_, device), group in sorted(groups.items(), key=lambda item: str(item[0])):  # same order everywhere
            flat = torch.cat([b.detach().reshape(-1) for b in group])
            flat = strategy.broadcast_tensor(flat.to("cpu") if device.type != "cpu" else flat)
            offset = 0
            for buffer in group:
                buffer.copy_(flat[offset:offset + buffer.numel()].view_as(buffer))
                offset += buffer.numel()

