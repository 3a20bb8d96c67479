"""`DeviceMesh` and `TensorLayout`: Keras 3's values, each with its ``mf.dtensor`` counterpart.

A `DeviceMesh` is a value (shape, axis names, devices) until something trains on it: its
``backend_mesh`` (as Keras's) is the ``meshfit.dtensor.Mesh`` of the job's processes, formed on
first use by the same machinery as ``mf.dtensor.create_mesh`` (from a plain script with several
local devices, the other processes are started here, as ``MirroredStrategy`` does). The axes keep
their Keras names there; a distribution's ``batch_dim_name`` gives its axis the data role
(`ParallelDims`), whatever the axis is called.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from meshfit.distribution import _devices
from meshfit.dtensor import UNSHARDED, AxisRole, Layout, Mesh, ParallelDims, create_mesh


class DeviceMesh:
    """A cluster of devices with named axes, as ``keras.distribution.DeviceMesh``.

    Args:
        shape: the size of each axis, e.g. ``(8,)`` for data parallel or ``(4, 2)`` for data and
            model parallel.
        axis_names: one name per axis, e.g. ``["batch", "model"]``.
        devices: the devices, ``prod(shape)`` of them (default: `list_devices()`).

    Raises:
        ValueError: empty ``shape`` or ``axis_names``, different lengths, or a number of devices
            other than ``prod(shape)``.

    Example:
        >>> mesh = DeviceMesh((4, 2), ["batch", "model"], [f"cpu:{i}" for i in range(8)])
        >>> mesh.devices.shape
        (4, 2)
    """

    def __init__(self, shape: Sequence[int], axis_names: Sequence[str], devices: Any = None) -> None:
        if not shape or not axis_names:
            raise ValueError(f"Shape and axis_names cannot be empty. Received: shape={shape}, axis_names={axis_names}")
        if len(shape) != len(axis_names):
            raise ValueError(f"Shape and axis_names should have same size. Received: shape={shape}, "
                             f"axis_names={axis_names}")
        if devices is None:
            devices = _devices.list_devices()
        devices = np.array(devices)
        if math.prod(shape) != math.prod(devices.shape):
            raise ValueError(f"Shape does not match the number of devices. Received: shape={shape}; "
                             f"devices.shape={devices.shape}. List {math.prod(shape)} devices (one per process), "
                             "or change the shape.")
        self._shape = shape
        self._axis_names = axis_names
        self._devices = np.reshape(devices, shape)
        self._backends: dict[tuple[str, ...], Mesh] = {}  # by the axes' roles

    @property
    def shape(self) -> Sequence[int]:
        return self._shape

    @property
    def axis_names(self) -> Sequence[str]:
        return self._axis_names

    @property
    def devices(self) -> np.ndarray:
        return self._devices

    @property
    def backend_mesh(self) -> Mesh:
        """The ``meshfit.dtensor.Mesh`` of the job's processes (formed on first use)."""
        return self.mesh_for(None)

    def dims_for(self, batch_dim_name: str | None) -> ParallelDims:
        """The axes' `ParallelDims` with ``batch_dim_name`` the data axis (the only one); None: each axis
        takes the role its name implies (``"batch"`` data, ``"pipe"`` pipeline, any other name tensor).

        Raises:
            ValueError: ``batch_dim_name`` is not one of the mesh's axes.

        Example:
            >>> DeviceMesh((2, 2), ["dp", "tp"], [f"cpu:{i}" for i in range(4)]).dims_for("dp")
            ParallelDims(dp=2:data, tp=2:tensor)
        """
        dims = ParallelDims(names=tuple(self._axis_names), degrees=tuple(int(size) for size in self._shape))
        if batch_dim_name is None:
            return dims
        if batch_dim_name not in dims.names:
            raise ValueError(f"Invalid `batch_dim_name`: expected one of the DeviceMesh's axes {list(dims.names)}, "
                             f"received batch_dim_name={batch_dim_name!r}. Pass one of them, or add that axis to "
                             "the DeviceMesh.")
        if dims.data_axis not in (None, batch_dim_name):  # an axis named "batch" that is not the data axis
            dims = dims.with_role(dims.data_axis, AxisRole.TENSOR)
        return dims.with_role(batch_dim_name, AxisRole.DATA)

    def mesh_for(self, batch_dim_name: str | None) -> Mesh:
        """The processes' mesh (the same axis names) whose data axis is ``batch_dim_name`` (`dims_for`)."""
        dims = self.dims_for(batch_dim_name)
        key = tuple(role.value for role in dims.roles)
        if key not in self._backends:
            axes = list(zip(dims.names, dims.degrees, strict=True))
            self._backends[key] = create_mesh(axes, devices=[str(d) for d in self._devices.ravel()],
                                              roles=dims.explicit_roles() or None)
        return self._backends[key]

    def __repr__(self) -> str:
        return f"<{self.__class__.__name__} shape={self.shape}, axis_names={self.axis_names}>"

    def __str__(self) -> str:
        return self.__repr__()


class TensorLayout:
    """How a tensor is split over a `DeviceMesh`, as ``keras.distribution.TensorLayout``.

    Args:
        axes: one mesh axis name per tensor dim, or None for a dim that is not split.
        device_mesh: the mesh (default: set later, e.g. by the `LayoutMap` it is put in).

    Raises:
        ValueError: an axis is not one of the mesh's.
    """

    def __init__(self, axes: Sequence[str | None], device_mesh: DeviceMesh | None = None) -> None:
        self._axes = tuple(axes)
        self._device_mesh = device_mesh
        self._validate_axes()

    @property
    def axes(self) -> tuple[str | None, ...]:
        return self._axes

    @property
    def device_mesh(self) -> DeviceMesh | None:
        return self._device_mesh

    @device_mesh.setter
    def device_mesh(self, device_mesh: DeviceMesh) -> None:
        if self._device_mesh is not None:
            raise ValueError(f"Cannot override device mesh value. Existing value is {self._device_mesh}")
        self._device_mesh = device_mesh
        self._validate_axes()

    @property
    def backend_layout(self) -> Layout:
        """The ``meshfit.dtensor.Layout`` on the mesh's processes."""
        return self.layout_for(None)

    def layout_for(self, batch_dim_name: str | None) -> Layout:
        """The ``meshfit.dtensor.Layout`` on ``device_mesh.mesh_for(batch_dim_name)``."""
        if self._device_mesh is None:
            raise ValueError(f"Cannot create sharding when device mesh is not set for {self!r}. Pass "
                             "device_mesh=..., or put the layout in a LayoutMap.")
        mesh = self._device_mesh.mesh_for(batch_dim_name)
        return Layout(tuple(UNSHARDED if axis is None else axis for axis in self._axes), mesh)

    def _validate_axes(self) -> None:
        if self._device_mesh:
            valid_axis_names = set(self._device_mesh.axis_names)
            axis_names = set(self._axes) - {None}
            if axis_names - valid_axis_names:
                raise ValueError(f"Invalid axis names for Layout. Valid axis names: {valid_axis_names}, Got "
                                 f"{axis_names}")

    def __repr__(self) -> str:
        return f"<{self.__class__.__name__} axes={self.axes}, device_mesh={self.device_mesh}>"

    def __str__(self) -> str:
        return self.__repr__()
