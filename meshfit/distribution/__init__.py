"""Keras 3's distribution API (``keras.distribution``), the successor of the DTensor API, on ``mf.dtensor``.

Name a mesh of devices, say how weights are split over it, set the distribution, and create and fit
the model as usual::

    devices = mf.distribution.list_devices()           # the job's devices, one per process
    mesh = mf.distribution.DeviceMesh((2, 2), ["batch", "model"], devices)
    layout_map = mf.distribution.LayoutMap(mesh)
    layout_map["feature.*weight"] = ("model", None)    # whole-path regular expressions
    mf.distribution.set_distribution(mf.distribution.ModelParallel(layout_map=layout_map))
    model = mf.Model(SubclassedModel())
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(ds_train, epochs=3)

`ModelParallel` runs the placement of ``mf.dtensor.LayoutMap.fully_sharded`` with the same keys when they
split ``nn.Linear``/``nn.Embedding`` weights (tensor parallel, plain local activations, every weight sharded
over the data axis); ``LayoutMap.fully_sharded(mesh)`` is fully sharded data parallel in these names.
`DataParallel` replicates every weight instead. A `DeviceMesh`'s ``backend_mesh`` is a
``meshfit.dtensor.Mesh``; the distribution trains with that mesh's strategy.
"""

from meshfit._export import publish as _publish
from meshfit.distribution._devices import get_device_count, list_devices
from meshfit.distribution._distribution import (
    DataParallel,
    Distribution,
    ModelParallel,
    distribution,
    set_distribution,
)
from meshfit.distribution._layout_map import LayoutMap
from meshfit.distribution._mesh import DeviceMesh, TensorLayout

__all__ = [
    "DataParallel",
    "DeviceMesh",
    "Distribution",
    "LayoutMap",
    "ModelParallel",
    "TensorLayout",
    "distribution",
    "get_device_count",
    "list_devices",
    "set_distribution",
]

_publish(__name__)
