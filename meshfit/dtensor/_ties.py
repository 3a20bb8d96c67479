"""Tied parameters: one parameter reachable by several paths (``output.weight = tok_embeddings.weight``).

A tie is one tensor, so it has one layout: the layout a key gives any of its paths (a path no key
matches follows the keyed one). Keys that give its paths different layouts are refused by name when
the model is created, since two differently split copies could not stay one parameter.

Placement that replaces parameters module by module (torch's ``parallelize_module``, ``to_empty`` on
the meta device) makes one new tensor per holding module; `retie` puts the first path's parameter
back on every other path afterwards, as torch's tensor-parallel examples tie ``output.weight`` after
``parallelize_module``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from meshfit.dtensor._layout import Layout


def tied_groups(module: nn.Module) -> list[list[str]]:
    """The paths of each parameter reachable by more than one path, in ``named_parameters`` order."""
    groups: dict[int, list[str]] = {}
    for path, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(path)
    return [paths for paths in groups.values() if len(paths) > 1]


def keyed_layouts(module: nn.Module, lookup: Callable[[str], Layout | None]) -> dict[str, Layout | None]:
    """Every parameter path (tied ones included) and its key's layout, or None; a tied path no key
    matches gets the layout keyed for another path of its tie.

    Raises:
        ValueError: two paths of one tied parameter are keyed with different layouts.
    """
    layouts = {path: lookup(path) for path, _ in module.named_parameters(remove_duplicate=False)}
    for paths in tied_groups(module):
        keyed = [(path, layouts[path]) for path in paths if layouts[path] is not None]
        first_path, first = keyed[0] if keyed else (paths[0], None)
        for path, layout in keyed[1:]:
            if layout != first:
                raise ValueError(_conflict(first_path, first, path, layout))
        for path in paths:
            layouts[path] = first
    return layouts


def _conflict(first_path: str, first: Any, path: str, layout: Any) -> str:
    return (f"Invalid layouts for tied parameter {first_path!r}: it is the same parameter as {path!r} (tied), "
            f"but the LayoutMap gives {first_path!r} {list(first.sharding_specs)} and {path!r} "
            f"{list(layout.sharding_specs)}; one parameter has one layout. Give both paths the same layout, key "
            "only one of them (the other follows it), or untie the parameter.")


def retie(module: nn.Module, groups: list[list[str]]) -> None:
    """Put the parameter at each group's first path on its other paths (after a per-module placement)."""
    for paths in groups:
        shared = module.get_parameter(paths[0])
        for path in paths[1:]:
            prefix, _, name = path.rpartition(".")
            owner = module.get_submodule(prefix) if prefix else module
            if owner._parameters.get(name) is not shared:
                owner.register_parameter(name, shared)
