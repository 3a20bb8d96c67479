"""Layouts on a device mesh, as ``tf.experimental.dtensor``, on torch DTensor.

Create a mesh of processes with named axes, say how each weight is split over them with a
`LayoutMap` (regular expressions over weight paths), and train with the same ``fit``. Each axis has
a role (`ParallelDims`, `AxisRole`): ``"batch"`` is the data axis unless ``roles=`` names another::

    mesh = mf.dtensor.create_mesh([("batch", 2), ("model", 2)], devices=[f"cpu:{i}" for i in range(4)])
    layout_map = mf.dtensor.LayoutMap(mesh)
    layout_map["feature.*weight"] = mf.dtensor.Layout(["model", mf.dtensor.UNSHARDED], mesh)
    with layout_map.scope():
        model = mf.Model(SubclassedModel())
"""

from meshfit._export import publish as _publish
from meshfit.distribute import AxisRole, ParallelDims, ReleasedParameter
from meshfit.dtensor._apply import apply_layouts
from meshfit.dtensor._create import create_mesh
from meshfit.dtensor._lay_out import lay_out as lay_out  # gives layout_map.scope() its layout function
from meshfit.dtensor._layout import UNSHARDED, Layout
from meshfit.dtensor._layout_map import LayoutMap
from meshfit.dtensor._mesh import Mesh
from meshfit.dtensor._pack import copy_to_mesh, pack, unpack

# Seams for meshfit's other packages (not public API: not in __all__).
from meshfit.dtensor._pack import local_rows as local_rows
from meshfit.dtensor._strategy import MeshStrategy

__all__ = [
    "UNSHARDED",
    "AxisRole",
    "Layout",
    "LayoutMap",
    "Mesh",
    "MeshStrategy",
    "ParallelDims",
    "ReleasedParameter",
    "apply_layouts",
    "copy_to_mesh",
    "create_mesh",
    "pack",
    "unpack",
]

_publish(__name__)
