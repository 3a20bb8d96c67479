"""The whole-mesh layout path's boundary: plain inputs become batch-sharded DTensors at the module's
forward, its outputs this process's rows again (`Boundary`), and a layer's partial sums are settled
where they are made (`settle_partial_sums`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshfit.data import map_structure
from meshfit.distribute import placement_hook


class Boundary:
    """Forward hooks: plain inputs become batch-sharded DTensors; outputs become this process's rows.

    Inputs that are DTensors already (``pack``) are left alone, and so are the outputs of such a
    call: the caller works with DTensors. The gradient reaching the local outputs is weighted by
    this process's share of the global batch (``batch_weight``): DTensor sums the data shards'
    gradients, so each shard's mean loss must count by its share.
    """

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.placements = strategy.batch_placements()
        self._converted: list[bool] = []

    def install(self, module: nn.Module) -> None:
        def before(*args: Any) -> Any:
            return self.before(*args)

        def after(*args: Any) -> Any:
            return self.after(*args)

        # Recorded so that saving still describes the module as its plain layers (no math changes here).
        module.register_forward_pre_hook(placement_hook(before), with_kwargs=True)
        module.register_forward_hook(placement_hook(after), with_kwargs=True)
        for name, submodule in module.named_modules():
            if name:
                submodule.register_forward_hook(settle_partial_sums)

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        from torch.distributed.tensor import DTensor, Replicate

        converted = [False]
        mesh = self.strategy._device_mesh

        def to_dtensor(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor) or isinstance(leaf, DTensor):
                return leaf
            converted[0] = True
            placements = self.placements if leaf.dim() > 0 else [Replicate()] * mesh.ndim
            return DTensor.from_local(leaf, mesh, placements, run_check=False)

        args, kwargs = map_structure(to_dtensor, args), map_structure(to_dtensor, kwargs)
        self._converted.append(converted[0])
        return args, kwargs

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not self._converted.pop():
            return output
        from torch.distributed.tensor import DTensor, Replicate

        strategy, placements = self.strategy, self.placements

        def to_local(leaf: Any) -> Any:
            if not isinstance(leaf, DTensor):
                return leaf
            batched = leaf.dim() > 0
            target = placements if batched else [Replicate()] * len(placements)
            if tuple(leaf.placements) != tuple(target):
                leaf = leaf.redistribute(strategy._device_mesh, target)
            local = leaf.to_local(grad_placements=target)
            if batched and local.requires_grad:
                local.register_hook(lambda grad: grad * strategy._grad_factor)
            return local

        return map_structure(to_local, output)


@placement_hook
def settle_partial_sums(module: nn.Module, args: Any, output: Any) -> Any:
    """A layer's partial-sum output (weights split by input features) is summed where it is made.

    As tensor parallelism's row-wise layers do: the next layer then gets a whole tensor, its
    gradient comes back whole, and weight gradients stay local to their shards. Left partial,
    DTensor may carry the partial sum into the backward pass and reduce a full-size weight
    gradient instead (measured 0.8 s a step for a 4096 × 4096 weight here).
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    def settle(leaf: Any) -> Any:
        if isinstance(leaf, DTensor) and any(isinstance(p, Partial) for p in leaf.placements):
            placements = [Replicate() if isinstance(p, Partial) else p for p in leaf.placements]
            return leaf.redistribute(leaf.device_mesh, placements)
        return leaf

    return map_structure(settle, output)
