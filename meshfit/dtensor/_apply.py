"""Give a module's parameters their layouts: DTensors on the mesh, each exposing ``.layout``.

torch tensors already have a ``layout`` attribute (``torch.strided``). A parameter with a meshfit
layout gets a subclass of its own class whose ``layout`` is the `Layout` (falling back to the
torch layout when none is attached), so it stays a real ``DTensor`` / ``nn.Parameter``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from meshfit.dtensor._inputs import accept_inputs
from meshfit.dtensor._layout import Layout
from meshfit.dtensor._layout_map import LayoutMap
from meshfit.dtensor._mesh import Mesh
from meshfit.dtensor._ties import keyed_layouts

_SUBCLASSES: dict[type, type] = {}
_T = TypeVar("_T", bound=torch.Tensor)


def _with_layout_class(cls: type) -> type:
    """``cls`` with a ``layout`` property returning the attached `Layout` (made once per class)."""
    if getattr(cls, "_meshfit_layout_class", False):
        return cls
    if cls not in _SUBCLASSES:
        def layout(self: torch.Tensor) -> Any:
            attached = self.__dict__.get("_meshfit_layout")
            # torch's stub types Tensor.layout as a plain attribute; it is a descriptor at runtime.
            return attached if attached is not None else torch.Tensor.layout.__get__(self)  # type: ignore[attr-defined]

        def detach(self: torch.Tensor) -> torch.Tensor:  # Parameter(...) and module.to() need detach's type
            detached = torch.Tensor.detach(self)  # the class's own detach (DTensor's, through dispatch)
            return attach_layout(detached, self.__dict__["_meshfit_layout"]) if type(detached) is cls else detached

        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"layout": property(layout), "_meshfit_layout_class": True,
                                                       "detach": detach, "__module__": cls.__module__})
    return _SUBCLASSES[cls]


def attach_layout(tensor: _T, layout: Layout) -> _T:
    """Make ``tensor.layout`` return ``layout`` (in place; returns ``tensor``)."""
    tensor.__class__ = _with_layout_class(type(tensor))
    tensor.__dict__["_meshfit_layout"] = layout
    return tensor


def resolve_layouts(module: nn.Module, layouts: LayoutMap | Mapping[str, Layout],
                    mesh: Mesh | None = None) -> dict[str, Layout]:
    """Each parameter path of ``module`` and its layout (matched, else replicated), checked against its shape.

    Every path of a tied parameter gets the tie's one layout (`keyed_layouts`).

    Raises:
        ValueError: two keys match one path, a layout's rank does not fit its parameter (a dim its
            axis does not divide is split unevenly, as ``torch.chunk``), a parameter is still lazy,
            or one tied parameter is keyed with two layouts.
    """
    layout_map = as_layout_map(layouts, mesh)
    params = dict(module.named_parameters(remove_duplicate=False))
    for path, param in params.items():
        if is_lazy(param):
            raise ValueError(f"Parameter {path!r} is still lazy (uninitialized): run one forward pass first "
                             "(Model.fit does) so its shape is known before it gets a layout.")
    resolved: dict[str, Layout] = {}
    for path, keyed in keyed_layouts(module, layout_map.__getitem__).items():
        layout = keyed if keyed is not None else Layout.replicated(layout_map.mesh, params[path].dim())
        layout.check_shape(params[path].shape, f"parameter {path!r}")
        resolved[path] = layout
    return resolved


def as_layout_map(layouts: LayoutMap | Mapping[str, Layout], mesh: Mesh | None = None) -> LayoutMap:
    """A `LayoutMap` from a map or a plain dict of layouts (all on one mesh)."""
    if isinstance(layouts, LayoutMap):
        return layouts
    if not isinstance(layouts, Mapping):
        raise TypeError(f"Invalid `layout_map`: expected a meshfit.dtensor.LayoutMap or a dict of Layouts by "
                        f"weight path, received {type(layouts).__name__}.")
    meshes = {layout.mesh for layout in layouts.values() if isinstance(layout, Layout)}
    if mesh is None:
        if len(meshes) != 1:
            raise ValueError("Invalid `layout_map`: cannot tell the mesh from a dict with "
                             f"{'no layouts' if not meshes else 'layouts on several meshes'}; pass a LayoutMap.")
        mesh = next(iter(meshes))
    for layout in layouts.values():
        if isinstance(layout, Layout) and layout.mesh == mesh and layout.mesh._device_mesh is not None:
            mesh = layout.mesh  # the one that carries the processes
    layout_map = LayoutMap(mesh)
    for key, layout in layouts.items():
        layout_map[key] = layout
    return layout_map


def apply_layouts(module: nn.Module, layout_map: LayoutMap | Mapping[str, Layout]) -> nn.Module:
    """Replace ``module``'s parameters with DTensors laid out as ``layout_map`` says, in place.

    Every parameter becomes a ``torch.distributed.tensor.DTensor`` on the mesh (unmatched ones
    replicated); buffers become replicated DTensors. Values come from rank 0 (as DDP does), so
    every process starts from the same weights. Each parameter's ``.layout`` is its `Layout`.

    Args:
        module: a module with materialised parameters (on the mesh's device type).
        layout_map: a `LayoutMap`, or a dict of `Layout` by weight path (exact or regex keys).

    Returns:
        ``module`` itself.

    Raises:
        ValueError: see `resolve_layouts`.
        RuntimeError: the mesh was not made by `create_mesh` (no processes).
    """
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    layout_map = as_layout_map(layout_map)
    layouts = resolve_layouts(module, layout_map)
    device_mesh = layout_map.mesh.device_mesh
    replaced: dict[int, nn.Parameter] = {}
    for path, param in list(module.named_parameters(remove_duplicate=False)):
        owner, name = _owner(module, path)
        layout = layouts[path]  # a tied parameter's paths share one layout: it is replaced once, below
        if id(param) not in replaced and isinstance(param, DTensor) and param.device_mesh == device_mesh \
                and tuple(param.placements) == tuple(layout.placements):
            replaced[id(param)] = attach_layout(param, layout)  # laid out already: the same parameter
        if id(param) not in replaced:
            value = param.detach()
            if isinstance(value, DTensor):
                value = value.full_tensor()
            with torch.no_grad():
                dtensor = distribute_tensor(value, device_mesh, list(layout.placements))
            new = nn.Parameter(dtensor, requires_grad=param.requires_grad)
            replaced[id(param)] = attach_layout(new, layout)
        setattr(owner, name, replaced[id(param)])
    for path, buffer in list(module.named_buffers()):
        if buffer is None or isinstance(buffer, DTensor):
            continue
        owner, name = _owner(module, path)
        owner.register_buffer(name, distribute_tensor(buffer, device_mesh, [Replicate()] * device_mesh.ndim),
                              persistent=name not in owner._non_persistent_buffers_set)
    accept_inputs(module)  # plain and packed inputs both meet the new parameters
    return module


def _owner(module: nn.Module, path: str) -> tuple[nn.Module, str]:
    prefix, _, name = path.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), name
