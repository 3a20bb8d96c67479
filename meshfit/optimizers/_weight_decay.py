"""Keras's ``optimizer.exclude_from_weight_decay(var_list, var_names)``: the exempt parameters go into
torch parameter groups of their own with ``weight_decay=0``."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch


class WeightDecayExclusion:
    """Parameters exempt from weight decay: by identity (``var_list``), or by a name (a parameter's path
    in its module, e.g. ``"blocks.0.ln_1.weight"``) in which one of ``var_names`` is found (``re.search``)."""

    def __init__(self, var_list: Iterable[torch.Tensor] | None, var_names: Iterable[str] | None) -> None:
        self._ids = {id(v) for v in var_list or ()}
        names = sorted(set(var_names or ()))
        for name in names:
            if not isinstance(name, str):
                raise TypeError(f"Invalid `var_names`: expected strings, received {name!r} in var_names={names!r}.")
        self._pattern = re.compile("|".join(names)) if names else None

    def exempts(self, param: torch.Tensor, name: str | None) -> bool:
        """Whether ``param`` (named ``name``, None when unknown) is exempt."""
        if id(param) in self._ids:
            return True
        return self._pattern is not None and name is not None and self._pattern.search(name) is not None


def split_named(params: list[Any]) -> tuple[list[Any], dict[int, str]]:
    """``params`` without names (torch's ``named_parameters()`` pairs become tensors; groups stay) and the
    names by parameter id."""
    names: dict[int, str] = {}
    plain: list[Any] = []
    for item in params:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            names[id(item[1])] = item[0]
            plain.append(item[1])
        else:
            plain.append(item)
    return plain, names


def exempt_groups(params: list[Any], names: dict[int, str], exclusion: WeightDecayExclusion) -> list[Any]:
    """``params`` as parameter groups, each split into the decayed part and an exempt part (``weight_decay=0``)."""
    groups = [item for item in params if isinstance(item, dict)] or [{"params": params}]
    result: list[dict[str, Any]] = []
    for group in groups:
        members = list(group["params"])
        decayed = [p for p in members if not exclusion.exempts(p, names.get(id(p)))]
        exempt = [p for p in members if exclusion.exempts(p, names.get(id(p)))]
        if decayed:
            result.append({**group, "params": decayed})
        if exempt:
            result.append({**group, "params": exempt, "weight_decay": 0.0})
    return result
