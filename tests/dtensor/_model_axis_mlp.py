"""The small MLP the mesh tests train, and its layout map splitting it along the ``model`` axis.

``Linear(8, 16) -> ReLU -> Linear(16, 4)``, seeded: the first layer split by output rows (weight and bias),
the second by input columns, as Megatron splits an MLP.
"""

from __future__ import annotations

import torch
from torch import nn


def mlp() -> nn.Sequential:
    """The MLP with the weights of ``torch.manual_seed(0)``."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def model_axis_layouts(mesh):
    """A ``LayoutMap`` on ``mesh`` that splits :func:`mlp`'s first layer by rows and its second by columns."""
    import meshfit as mf

    layout_map = mf.dtensor.LayoutMap(mesh)
    layout_map[r"^0\.weight$"] = mf.dtensor.Layout(["model", mf.dtensor.UNSHARDED], mesh)
    layout_map[r"^0\.bias$"] = mf.dtensor.Layout(["model"], mesh)
    layout_map[r"^2\.weight$"] = mf.dtensor.Layout([mf.dtensor.UNSHARDED, "model"], mesh)
    return layout_map
