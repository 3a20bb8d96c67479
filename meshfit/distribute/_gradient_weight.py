"""A DDP communication hook that weights each replica's gradient by its share of the global batch.

DDP averages the replicas' gradients. That is the gradient of the global batch's mean loss only when
every replica holds the same number of examples; for a last, uneven global batch, replica ``r``
with ``n_r`` of ``B`` examples must contribute ``n_r / B`` of its mean-loss gradient, i.e. its
gradient times ``n_r * N / B`` before the average. Doing it in the all-reduce (not by scaling the
loss in ``Model.train_step``) makes it hold for any ``train_step`` a user writes.

With ``compression="bfloat16"`` (``CommunicationOptions(gradient_compression=...)``) the bucket is
all-reduced as bfloat16, as torch's ``bf16_compress_hook`` does for NCCL, but on any backend (gloo
sums bfloat16 too): half the bytes, the result rounded once per replica before the sum.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as real types.
import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook


@dataclasses.dataclass
class GradientWeight:
    """The factor the next backward's gradients are multiplied by (1.0: untouched, bitwise)."""

    factor: float = 1.0
    in_step: bool = False  # inside a step of fit (set with factor by the strategy's batch_weight)
    process_group: "dist.ProcessGroup | None" = None
    compression: "str | None" = None  # None or "bfloat16"


def weighted_allreduce_hook(state: GradientWeight, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Scale the bucket by ``state.factor`` (when not 1), then average it: DDP's own all-reduce, or a
    bfloat16 one written back into the bucket."""
    buffer = bucket.buffer()
    if state.factor != 1.0:
        buffer.mul_(state.factor)
    if state.compression is None:
        # torch's stub asks a ProcessGroup; the hook itself takes None as the default group (as DDP passes).
        return allreduce_hook(state.process_group, bucket)  # type: ignore[arg-type]
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    reduced = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(future.value()[0])
        return buffer

    return reduced.then(decompress)
