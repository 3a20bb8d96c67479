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
from meshfit._protocols import DistributionStrategy, Residency
from meshfit.distribute._residency import EVERYWHERE


def agree_buffers(module: torch.nn.Module, strategy: DistributionStrategy, residency: Residency = EVERYWHERE) -> None:
    """Give every replica rank 0's values of ``module``'s buffers, in place (collective).

    Every replica of ``strategy`` must call it at the same point; it does nothing for one replica.
    Where ranks hold different parts (``residency``: a pipeline's stages), each stage's buffers are its
    own: the ranks of a stage give theirs the values of the stage's first replica (over the data axis),
    and no rank's copy of another stage's buffers is read.
    """
    if strategy.num_replicas_in_sync <= 1:
        return
    if not residency.everywhere:
        _agree_held_buffers(module, strategy, residency)
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


def _agree_held_buffers(module: torch.nn.Module, strategy: DistributionStrategy, residency: Residency) -> None:
    """The buffers this rank's stages hold, from the first replica of each stage (a broadcast over the data
    axis: the replicas of a stage hold the same paths, and other stages' replicas take no part)."""
    world = strategy.world
    axis = world.data_axis_of(world.device_mesh) if world.device_mesh is not None else None
    if axis is None:
        return
    held = [b for path, b in module.named_buffers() if residency.holds(path) and not is_lazy(b)
            and not is_dtensor(b) and b.numel()]
    if held:
        world.broadcast_tensors(held, src=0, axis=axis)
