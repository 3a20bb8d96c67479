"""A pipeline stage's parameters as one module, apart from the traced graphs that run them.

torch's tracer (``torch.distributed.pipelining.pipeline``) gives one graph module per stage and per
traced batch shape and mode; a pipeline traces again for a last, smaller batch and for evaluation.
Each graph reads its weights as attributes. A `StageUnit` holds the stage's own parameters once
(the user's parameter objects, by their paths) and runs whichever traced graph is active with those
parameters bound into it at each call: every graph trains the same weights, and a transform of the
unit (``fully_shard`` over the data axis) applies once to the stage, whatever is traced later.

Tracing never needs the weights' values, only their shapes: `tracing_template` is a copy of the
module whose parameters are placeholders of one element each (the user's buffers are shared, not
copied), so the tracer runs while the stage's parameters are sharded, and a process keeps no second
copy of the model.

Under ``fully_shard`` the unit is the stage's FSDP module: torch's schedules recognise it
(``PipelineStage.submod``), keep the microbatches' gradients unreduced and reduce-scatter them once
after the last backward; during the unit's forward its parameters are the all-gathered ones, and
those are what the graph reads.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


class StageUnit(nn.Module):
    """The parameters of one stage (``paths`` of ``source``), and the traced graph that runs them."""

    def __init__(self, source: nn.Module, paths: Iterable[str], tensor_mesh: Any = None) -> None:
        super().__init__()
        self.tensor_mesh = tensor_mesh  # the weights are DTensors on it (`_stage_layouts`): run on DTensors
        self.holders = nn.ModuleList()
        self._where: dict[str, tuple[nn.Module, str]] = {}  # parameter path -> (holder, name)
        by_owner: dict[str, list[str]] = {}
        for path in sorted(paths):
            owner, _, name = path.rpartition(".")
            if name in source.get_submodule(owner)._parameters:
                by_owner.setdefault(owner, []).append(name)
        for owner, names in by_owner.items():
            holder = nn.Module()
            for name in names:
                holder.register_parameter(name, source.get_submodule(owner)._parameters[name])
                self._where[f"{owner}.{name}" if owner else name] = (holder, name)
            self.holders.append(holder)
        self._graph_module: Any = None
        self._bindings: dict[int, list[tuple[nn.Module, str, nn.Module, str]]] = {}

    @property
    def paths(self) -> list[str]:
        return list(self._where)

    def current(self, path: str) -> nn.Parameter:
        """The parameter object the unit holds at ``path`` now (a sharded one after ``fully_shard``)."""
        holder, name = self._where[path]
        return holder._parameters[name]  # type: ignore[return-value]

    def bind_into(self, source: nn.Module) -> None:
        """Point ``source``'s attributes at the unit's parameter objects (after a transform replaced them)."""
        for path, (holder, name) in self._where.items():
            owner, _, attr = path.rpartition(".")
            source.get_submodule(owner)._parameters[attr] = holder._parameters[name]

    def used(self, graph_module: nn.Module) -> list[str]:
        """The unit's paths ``graph_module`` reads (a parameter its forward never uses is not in it)."""
        return [path for path, _ in graph_module.named_parameters(remove_duplicate=False) if path in self._where]

    def activate(self, graph_module: nn.Module) -> None:
        """Run ``graph_module`` (one traced stage) at the next calls, with the unit's parameters."""
        if id(graph_module) not in self._bindings:
            bindings = []
            for path, _ in graph_module.named_parameters(remove_duplicate=False):
                owner, _, name = path.rpartition(".")
                holder, held = self._where[path]
                bindings.append((graph_module.get_submodule(owner), name, holder, held))
            self._bindings[id(graph_module)] = bindings
        self._graph_module = graph_module

    @property
    def graph(self) -> Any:
        """The active traced stage's graph (torch's stage reads its inputs and outputs from it)."""
        return self._graph_module.graph

    def forward(self, *args: Any) -> Any:
        for module, name, holder, held in self._bindings[id(self._graph_module)]:
            module._parameters[name] = holder._parameters[held]  # the all-gathered one inside FSDP's forward
        if self.tensor_mesh is None:
            return self._graph_module(*args)
        return _on_tensor_mesh(self._graph_module, self.tensor_mesh, args)


def _on_tensor_mesh(graph_module: nn.Module, mesh: Any, args: tuple[Any, ...]) -> Any:
    """Run ``graph_module`` on DTensors of ``mesh``: the inputs replicated, the outputs made whole again
    (DTensor's propagation computes each operation of split weights as one process does)."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.utils._pytree import tree_map

    def enter(value: Any) -> Any:
        return DTensor.from_local(value, mesh, [Replicate()], run_check=False) \
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) else value

    def leave(value: Any) -> Any:
        return value.redistribute(mesh, [Replicate()]).to_local() if isinstance(value, DTensor) else value

    # a tensor the graph creates (positions from torch.arange) counts as replicated: the step runs the whole
    # schedule, backward included, under torch's implicit_replication (`PipelineStep._on_tensor_axis`)
    return tree_map(leave, graph_module(*tree_map(enter, args)))


def tracing_template(module: nn.Module) -> nn.Module:
    """A copy of ``module`` for the tracer: each parameter a one-element placeholder of its shape (tied
    parameters stay tied), each buffer the module's own."""
    memo: dict[int, Any] = {}
    for param in module.parameters():
        placeholder = torch.empty((), dtype=param.dtype, device=param.device).expand(param.shape)
        memo[id(param)] = nn.Parameter(placeholder, requires_grad=param.requires_grad)
    for buffer in module.buffers():
        memo[id(buffer)] = buffer
    return copy.deepcopy(module, memo)


def follow_modes(source: nn.Module, template: nn.Module) -> None:
    """Give ``template``'s modules the training flags of ``source``'s (``model.train()``/``eval()``)."""
    for theirs, ours in zip(source.modules(), template.modules(), strict=True):
        ours.training = theirs.training
