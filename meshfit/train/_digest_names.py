"""The names a checkpoint's digest record uses: `meshfit.train.state_digest`'s, where they exist.

A checkpoint stores tensors under DCP keys (``module/0.weight``,
``optimizer/optimizer/state/0/exp_avg``); `state_digest` names the same tensors by the module's path
(``0.weight``) and the optimizer's state by its parameter's path (``optimizer/0.weight/exp_avg``). The
record uses the second names, so a backup's digest and ``state_digest(model)`` can be compared key by
key, and keeps the DCP key of each renamed tensor for the restore that checks it. A checkpoint holding
one module (and optimizers over its parameters) is renamed; any other trackable keeps its DCP keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def _wraps_torch_optimizer(target: Any) -> bool:
    """A meshfit optimizer (its torch optimizer and step count), told by its class: reading
    ``torch_optimizer`` of one not built yet raises."""
    return isinstance(getattr(type(target), "torch_optimizer", None), property) and hasattr(target, "iterations")


def digest_paths(trackables: Mapping[str, Any], owners: Mapping[str, str]) -> dict[str, str]:
    """``state_digest``'s path of each DCP key in ``owners`` (key -> trackable name) that has one."""
    modules = [name for name, target in trackables.items() if isinstance(target, torch.nn.Module)]
    if len(modules) != 1:
        return {}
    module_name = modules[0]
    module = trackables[module_name]
    names = {id(p): path for path, p in module.named_parameters()}
    renamed: dict[str, str] = {}
    for key, owner in owners.items():
        if owner == module_name:
            renamed[key] = key[len(module_name) + 1:]
            continue
        target = trackables[owner]
        inner = f"{owner}/optimizer/state/" if _wraps_torch_optimizer(target) else f"{owner}/state/"
        optimizer = _torch_optimizer(target)
        if optimizer is None or not key.startswith(inner):
            continue
        index, _, state_name = key[len(inner):].partition("/")
        parameter = _parameter_name(optimizer, int(index), names) if index.isdigit() else None
        if parameter is not None:
            renamed[key] = f"optimizer/{parameter}/{state_name}"
    return renamed if len(set(renamed.values())) == len(renamed) else {}


def optimizer_steps(trackables: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``optimizer/iterations`` as `state_digest` digests it, for the one meshfit optimizer saved (if one)."""
    optimizers = [t for t in trackables.values() if _wraps_torch_optimizer(t)]
    if len(optimizers) != 1 or not getattr(optimizers[0], "built", True):
        return {}
    return {"optimizer/iterations": torch.tensor(int(optimizers[0].iterations), dtype=torch.int64)}


def _torch_optimizer(target: Any) -> torch.optim.Optimizer | None:
    if isinstance(target, torch.optim.Optimizer):
        return target
    if _wraps_torch_optimizer(target) and getattr(target, "built", True):
        optimizer = target.torch_optimizer
        return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    return None


def _parameter_name(optimizer: torch.optim.Optimizer, index: int, names: Mapping[int, str]) -> str | None:
    """The module path of the optimizer's ``index``-th parameter (torch numbers them across groups)."""
    seen = 0
    for group in optimizer.param_groups:
        params = group["params"]
        if index < seen + len(params):
            return names.get(id(params[index - seen]))
        seen += len(params)
    return None
