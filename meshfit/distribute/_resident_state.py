"""A partly held state, completed from its holders: what a backup and ``model.save`` write.

Under a `Residency` that is not `EVERYWHERE` (pipeline stages) a rank holds only some of the state;
its copies of the other paths are stale or absent. `ResidentModule` and `ResidentOptimizer` wrap the
module and the optimizer as a checkpoint's trackables: their ``state_dict`` is the whole state, each
path's tensor broadcast from the first rank that holds it (collective: every rank calls it, as every
rank saves), so a checkpoint has the keys and values of one process's; their ``load_state_dict`` loads
the whole state and drops the optimizer state of the parameters this rank does not train. A backup
therefore restores on any placement: other pipeline depths, one plain process.
"""

from __future__ import annotations

import collections
from typing import Any, Protocol

import torch
from torch import nn

from meshfit._lazy_dtensor import placed_like, whole
from meshfit.distribute._released import is_released
from meshfit.distribute._residency import Residency


class _World(Protocol):
    distributed: bool
    rank: int

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int = 0, axis: str | None = None) -> None: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...


class _TorchOptimized(Protocol):
    """A built meshfit optimizer (its torch optimizer) with Keras's state dict."""

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def complete_tensors(state: dict[str, torch.Tensor], residency: Residency, world: _World) -> dict[str, torch.Tensor]:
    """``state`` with each path this rank does not hold replaced by its first holder's tensor.

    One broadcast per holder and dtype (the holder's tensors flattened into one buffer), in path
    order on every rank; every rank must hold the same paths in ``state`` (a module's state dict).
    """
    if residency.everywhere or not world.distributed:
        return state
    state = _full(state)  # a sharded stage's tensors: whole, gathered among its holders (each calls it)
    by_source: dict[tuple[int, torch.dtype], list[str]] = collections.defaultdict(list)
    for path, tensor in state.items():
        holders = residency.holders(path)
        if holders:
            by_source[(holders[0], tensor.dtype)].append(path)
    completed = dict(state)
    for (source, _), paths in sorted(by_source.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        tensors = [state[p].detach() for p in paths]
        flat = torch.cat([t.reshape(-1) for t in tensors]) if world.rank == source \
            else torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
        world.broadcast_tensors([flat], src=source)
        if world.rank != source:
            offset = 0
            for path, tensor in zip(paths, tensors, strict=True):
                completed[path] = flat[offset:offset + tensor.numel()].view(tensor.shape).clone()
                offset += tensor.numel()
    return completed


class ResidentModule:
    """A module's state completed from its holders (see the module docstring); a checkpoint trackable."""

    def __init__(self, module: nn.Module, residency: Residency, world: _World) -> None:
        self.module, self.residency, self.world = module, residency, world

    def state_dict(self) -> dict[str, torch.Tensor]:
        return complete_tensors(self.module.state_dict(), self.residency, self.world)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load the paths this rank holds (a released one, another stage's, keeps only its shape)."""
        released = {path for path, param in self.module.named_parameters(remove_duplicate=False)
                    if is_released(param)}
        current = self.module.state_dict()
        result = self.module.load_state_dict({path: placed_like(value, current.get(path)) for path, value in state.items()
                                              if path not in released}, strict=False)
        missing = sorted(set(result.missing_keys) - released)
        if missing or result.unexpected_keys:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self.module).__name__}: missing keys "
                               f"{missing}, unexpected keys {result.unexpected_keys}. Load a state of this model.")


class ResidentOptimizer:
    """An optimizer's state completed from the ranks that train each parameter; a checkpoint trackable.

    The torch optimizer's state is keyed by parameter index (its position in the parameter groups,
    the same on every rank: each builds the optimizer over the whole module); each index's entry
    comes from the first rank that holds its parameter.
    """

    def __init__(self, optimizer: _TorchOptimized, module: nn.Module, residency: Residency, world: _World) -> None:
        self.optimizer, self.module, self.residency, self.world = optimizer, module, residency, world

    def _paths(self) -> list[str]:
        names = {id(p): name for name, p in self.module.named_parameters()}
        return [names.get(id(p), "") for group in self.optimizer.torch_optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        state = self.optimizer.state_dict()
        if self.residency.everywhere or not self.world.distributed:
            return state
        entries: dict[int, Any] = {index: _full(entry) if isinstance(entry, dict) else entry
                                   for index, entry in sorted(state["optimizer"]["state"].items())}
        by_source: dict[int, list[int]] = collections.defaultdict(list)
        for index, path in enumerate(self._paths()):
            holders = self.residency.holders(path) if path else ()
            if holders:
                by_source[holders[0]].append(index)
        sourced = {index for indices in by_source.values() for index in indices}
        merged = {index: entry for index, entry in entries.items() if index not in sourced}
        for source in sorted(by_source):
            mine = {i: entries[i] for i in by_source[source] if i in entries} if self.world.rank == source \
                else None
            received = self.world.broadcast_object(mine, src=source)
            merged.update(received)
        completed = dict(state)
        completed["optimizer"] = {**state["optimizer"], "state": dict(sorted(merged.items()))}
        if "ema" in state:  # the moving averages by parameter index: each from the rank that trains it
            paths = self._paths()
            by_path = {paths[int(i)]: average for i, average in state["ema"].items()}
            averages = complete_tensors(by_path, self.residency, self.world)
            completed["ema"] = {i: averages[paths[int(i)]] for i in state["ema"]}
        return completed

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
        if self.residency.everywhere:
            return
        torch_optimizer = self.optimizer.torch_optimizer
        params = [p for group in torch_optimizer.param_groups for p in group["params"]]
        for param, path in zip(params, self._paths(), strict=True):
            if path and not self.residency.holds(path):
                torch_optimizer.state.pop(param, None)  # another stage trains it


def _full(state: dict[Any, Any]) -> dict[Any, Any]:
    """``state`` with each sharded tensor (a DTensor: a fully sharded stage's) gathered whole, in key order."""
    return {key: whole(value) for key, value in state.items()}


def resident_parts(parts: dict[str, Any], module: nn.Module, residency: Residency, world: _World) -> dict[str, Any]:
    """A model's backup parts (``{"module": ..., "optimizer": ...}``) completed from their holders."""
    if residency.everywhere:
        return parts
    wrapped = dict(parts)
    for name, part in parts.items():
        if part is module:
            wrapped[name] = ResidentModule(module, residency, world)
        elif name == "optimizer" and part is not None:
            wrapped[name] = ResidentOptimizer(part, module, residency, world)
    return wrapped
