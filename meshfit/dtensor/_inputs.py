"""Plain tensors and packed DTensors both reach a laid-out module, whatever its parameters are.

TensorFlow's DTensor mixes a regular tensor with DTensor weights (it is copied to the mesh), and a
packed input with replicated weights. In torch, a ``DTensor`` meeting a plain ``Tensor`` in one op
is an error ("mixed torch.Tensor and DTensor"), so a module laid out by `apply_layouts` or a
``layout_map.scope()`` gets forward hooks at its boundary:

- **DTensor parameters, plain inputs**: each input is this process's rows (as in a custom loop
  under a strategy), so it becomes a DTensor split over the mesh's data axis (the axis whose role is
  data parallel, ``mesh.dims.data_axis``: ``batch`` by default; replicated when the mesh has none);
  outputs come back as this process's rows. Gradients of replicated weights are summed over the data
  axis by DTensor (TF's custom-loop contract: the loss is divided by the global
  batch by the user).
- **plain parameters, packed inputs** (an empty map: every weight replicated): each input becomes
  this process's rows, the outputs DTensors split over the data axis again, so the loss written on
  packed labels still meets them. The meshfit optimizer sums the gradients over the replicas.

Inputs that already match the parameters pass untouched. A module that a strategy placed (its own
boundary hooks, or ``fully_shard``) is left to that placement.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshfit._lazy_dtensor import is_dtensor
from meshfit.data import map_structure
from meshfit.distribute import PlacementHook
from meshfit.dtensor._pack import batch_dtensors, batch_placements, local_rows_of


def accept_inputs(module: nn.Module) -> Callable[[nn.Module, tuple, dict], Any]:
    """Install the boundary hooks on ``module`` once (see the module docstring).

    Returns:
        The pre-hook, ``hook(module, args, kwargs)`` -> converted ``(args, kwargs)`` or None.
    """
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, _Before):
            return hook
    before = _Before()
    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(_After(before), with_kwargs=True)
    return before


def _placed_by_a_strategy(module: nn.Module) -> bool:
    """A strategy's own placement hooks (mf.Model's boundary) or ``fully_shard`` handle the inputs."""
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, PlacementHook) and not isinstance(hook, _Before):
            return True
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


class _Before(PlacementHook):
    """The pre-hook: convert the inputs; remembers, per call, what the post-hook must undo."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        params = list(module.parameters())
        kinds = {is_dtensor(p) for p in params}
        if len(kinds) != 1 or _placed_by_a_strategy(module):  # none, a mix, or placed: leave them
            self.calls.append(None)
            return None
        if kinds == {True}:
            mesh = params[0].device_mesh  # type: ignore[attr-defined]  # a DTensor parameter
            args, in_args = batch_dtensors(args, mesh)
            kwargs, in_kwargs = batch_dtensors(kwargs, mesh)
            self.calls.append(("to_local", None) if in_args or in_kwargs else None)
            return args, kwargs
        args, mesh = local_rows_of(args)
        kwargs, kwargs_mesh = local_rows_of(kwargs)
        mesh = mesh if mesh is not None else kwargs_mesh
        self.calls.append(("to_dtensor", mesh) if mesh is not None else None)
        return args, kwargs


class _After(PlacementHook):
    """The post-hook: outputs back to what the caller passed in (local rows, or DTensors)."""

    def __init__(self, before: _Before) -> None:
        self.before = before

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        call = self.before.calls.pop() if self.before.calls else None
        if call is None:
            return output
        kind, mesh = call
        if kind == "to_local":
            return map_structure(lambda leaf: _rows(leaf) if is_dtensor(leaf) else leaf, output)
        return batch_dtensors(output, mesh)[0]


def _rows(tensor: Any) -> torch.Tensor:
    """This process's rows of a DTensor output, its gradient coming back split the same way."""
    target = batch_placements(tensor.device_mesh, tensor.dim())
    if tuple(tensor.placements) != tuple(target):
        tensor = tensor.redistribute(tensor.device_mesh, target)
    return tensor.to_local(grad_placements=target)
