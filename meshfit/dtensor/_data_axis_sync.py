"""Tensor-parallel weights replicated over the data axis: a plain ``LayoutMap``'s keys over ``model``.

A plain map keeps the weights its keys do not split replicated, and a keyed weight replicated along
the data axis (``Layout(["model", UNSHARDED], mesh)`` holds half the rows on each of a (2, 2) mesh's
processes). Its placement is the same tensor-parallel transform a fully sharded map's keys get
(`meshfit.dtensor._tensor_parallel.TensorParallel`: activations stay plain local tensors), then
`ReplicateOverData`: every gradient, a keyed weight's local shard or a plain weight's tensor, is
all-reduced over the data axis once at the end of the backward (`DataAxisSync`).

Weighting, as DDP's hook and fully sharded's reduce-scatter weight them (`GradientWeight`): inside
``fit``'s step each replica's gradient counts by its share of the global batch, then the replicas
average; outside ``fit`` (a custom loop) the replicas' gradients are summed, TF's contract with
``compute_average_loss``. A step kept local (a gradient accumulation window before its last batch)
reduces nothing; the window's last backward reduces the sum.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from meshfit.distribute import (
    DataParallelSync,
    GradientWeight,
    ReplicatedSync,
    World,
    placement_hook,
    scale_accumulated_gradients,
)


@dataclasses.dataclass(eq=False)
class DataAxisSync(ReplicatedSync):
    """The gradients of a tensor-parallel module all-reduced over the data axis; see the module docstring."""

    weight: GradientWeight
    replicas: int
    world: World
    axis: str
    _params: list[torch.Tensor] = dataclasses.field(default_factory=list, repr=False)
    _reduced: WeakIdKeyDictionary = dataclasses.field(default_factory=WeakIdKeyDictionary, repr=False)
    _local: bool = False  # a step kept local (gradient accumulation)
    _queued: bool = False  # the end-of-backward reduction is queued in the running backward

    def install(self, module: nn.Module) -> None:
        """Hooks on ``module``: weight this step's gradients at each training forward, reduce at the end of
        each backward."""
        self._params = [p for p in module.parameters() if p.requires_grad]
        weight, params = self.weight, self._params

        def pre_hook(module: nn.Module, args: Any) -> None:
            if torch.is_grad_enabled():
                scale_accumulated_gradients(weight, params)  # also a step kept local

        module.register_forward_pre_hook(placement_hook(pre_hook))
        if self.replicas < 2:  # one replica (a data axis of size 1): nothing to reduce
            return
        for param in params:
            param.register_post_accumulate_grad_hook(self._on_gradient)

    def _on_gradient(self, param: torch.Tensor) -> None:
        if self._local or self._queued:
            return
        self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._reduce)

    def _reduce(self) -> None:
        """One all-reduce over the data axis per dtype, of every gradient this backward produced."""
        from torch.distributed.tensor import DTensor

        self._queued = False
        held = [p for p in self._params if p.grad is not None]
        by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for param in held:
            grad = param.grad
            if grad is None:
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            by_dtype.setdefault(local.dtype, []).append((param, local))
        average = self.weight.in_step  # fit's step: weighted shares averaged; a custom loop: summed
        for pairs in by_dtype.values():
            flat = torch.cat([local.reshape(-1) for _, local in pairs])
            self.world.all_reduce(flat, axis=self.axis)
            if average:
                flat.div_(self.replicas)
            offset = 0
            for param, local in pairs:
                local.copy_(flat[offset:offset + local.numel()].view_as(local))
                offset += local.numel()
                self._reduced[param] = True

    def weighting(self, local_size: int, global_size: int) -> contextlib.AbstractContextManager[None]:
        return DataParallelSync.weighting_of(self.weight, self.replicas, local_size, global_size)

    def reduced(self, param: torch.Tensor) -> bool:
        """Whether this backward reduced ``param``'s gradient over the data axis."""
        return bool(self._reduced.pop(param, False))

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._local = True
        try:
            yield
        finally:
            self._local = False


@dataclasses.dataclass
class ReplicateOverData:
    """The plan's transform after tensor parallelism: `DataAxisSync`'s hooks on the module."""

    sync: DataAxisSync
    name: str = "replicate over the data axis"

    def apply(self, module: nn.Module) -> nn.Module:
        self.sync.install(module)
        return module
