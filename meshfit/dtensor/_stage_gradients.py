"""A pipeline stage's gradients: summed over the stage's replicas, kept apart from an accumulation window
while torch's schedule runs, and placed as their weights are.

torch's schedule divides every gradient it finds by the microbatches (``scale_grads``), so the step
takes an accumulation window's sum out before the schedule and adds it back after (`take_gradients`,
`give_back`). On a data axis a replicated stage's gradients are all-reduced here, each replica's
weighted by its rows (`Replicas`); a fully sharded stage's are reduce-scattered by FSDP inside the
schedule, weighted the same way (`ending` closes that weighting). Either way no optimizer step reduces
them again (`StageSync`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from meshfit._lazy_dtensor import local_part
from meshfit.distribute import GradientWeight


class Replicas:
    """A stage's replicas along the data axis: its gradients summed over them, each replica's weighted
    by its share of the global batch's rows (one process's mean over the global batch)."""

    def __init__(self, world: Any, axis: str, size: int) -> None:
        self.world, self.axis, self.size = world, axis, size

    def agree(self, rows: int, unsplittable: bool) -> tuple[int, bool]:
        """Every replica's rows summed, and whether any replica's batch does not split into microbatches (one
        small all-reduce before the schedule: every replica raises together, none waits for another's error)."""
        meta = torch.tensor([float(rows), float(unsplittable)], dtype=torch.float64, device=self.world.device)
        self.world.all_reduce(meta, axis=self.axis)
        return int(meta[0].item()), bool(meta[1].item())

    def reduce(self, params: Sequence[nn.Parameter], rows: int, total: int) -> None:
        """Sum the gradients of ``params`` (those the stage's forward uses: the same on every replica) over
        the replicas, this one's weighted by its ``rows`` of ``total``; zeros where a replica has none (its
        share of the batch was empty)."""
        share = rows / total if total else 0.0
        grads = []
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(local_part(param.grad))  # a stage's weight split over the tensor axis: its own part
        for dtype in sorted({g.dtype for g in grads}, key=str):
            group = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in group]) * share
            self.world.all_reduce(flat, axis=self.axis)
            offset = 0
            for g in group:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


class StageSync:
    """The `GradientSync` of a pipeline's parameters: the step runner reduced them (over the stage's
    replicas, or nothing to reduce), so no optimizer step reduces them again."""

    def weighting(self, local_size: int, global_size: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def in_step(self) -> bool:
        return True

    def reduced(self, param: torch.Tensor) -> bool:
        return True

    def deferred(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # the runner reduces every batch (an accumulation window sums after)


@contextlib.contextmanager
def ending(weight: GradientWeight) -> Iterator[None]:
    """The schedule's step inside ``weight``'s factor; back to idle after it (`GradientWeight.end_step`)."""
    try:
        yield
    finally:
        weight.end_step()


def settle(params: Sequence[nn.Parameter]) -> None:
    """A gradient DTensor's propagation left pending (``Partial``) or otherwise placed than its weight (split
    over the tensor axis), redistributed to the weight's placements."""
    for param in params:
        grad = param.grad
        placements = getattr(grad, "placements", None)
        if placements is not None and tuple(placements) != tuple(param.placements):  # type: ignore[attr-defined]
            param.grad = grad.redistribute(param.device_mesh, param.placements)  # type: ignore[union-attr,attr-defined]


def take_gradients(params: Sequence[nn.Parameter]) -> dict[nn.Parameter, torch.Tensor]:
    """The gradients ``params`` hold (an accumulation window's sum so far), taken out of them."""
    taken = {p: p.grad for p in params if p.grad is not None}
    for param in taken:
        param.grad = None
    return taken


def give_back(taken: dict[nn.Parameter, torch.Tensor], add: bool) -> None:
    """Put `take_gradients`' gradients back: added to this batch's (``add``), or as they were."""
    for param, grad in taken.items():
        if add and param.grad is not None:
            param.grad.add_(grad)
        else:
            param.grad = grad
