"""How ``layout_map.scope()`` lays out a module created inside it (given to `_scope_layouts`)."""

from __future__ import annotations

from torch import nn

from meshfit.dtensor._apply import apply_layouts, attach_layout, resolve_layouts
from meshfit.dtensor._layout_map import LayoutMap
from meshfit.dtensor._scope_layouts import set_lay_out


def lay_out(module: nn.Module, layout_map: LayoutMap) -> None:
    """DTensor parameters when the map has keys; for an empty map (every weight replicated) the
    parameters stay plain tensors, each exposing its replicated ``.layout``, as ``mf.Model``'s
    data-parallel placement keeps them."""
    if len(layout_map):
        apply_layouts(module, layout_map)
        return
    for path, layout in resolve_layouts(module, layout_map).items():
        attach_layout(module.get_parameter(path), layout)


set_lay_out(lay_out)
