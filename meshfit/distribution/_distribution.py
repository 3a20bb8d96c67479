"""`DataParallel`, `ModelParallel`, `set_distribution`: Keras 3's distribution API on meshfit's meshes.

A distribution set globally (`set_distribution`, or inside ``distribution.scope()``) is what
``mf.get_strategy()`` returns outside every strategy scope, so a model created and fitted then trains
on its mesh: `DataParallel` replicates every weight and splits each batch over the data axis
(torch DDP, as ``mf.dtensor`` does for a map without keys); `ModelParallel` lays the weights out as
its `LayoutMap` says, on the same placement as the ``mf.dtensor`` spelling: keyed ``nn.Linear`` /
``nn.Embedding`` weights split over one axis other than the data axis run tensor parallel with plain
local activations (tensors made inside ``forward`` meet them as they are), every weight sharded over
the data axis (``mf.dtensor.LayoutMap.fully_sharded`` with the same keys); other layouts make DTensor
parameters on the whole mesh. ``LayoutMap.fully_sharded(device_mesh)`` is fully sharded data
parallel in these names. The mesh's processes are formed when the first
model, optimizer or metric asks for the strategy, not before: building the objects needs none.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from meshfit._protocols import DistributionStrategy
from meshfit.distribute import global_distribution, set_global_distribution
from meshfit.distribution import _devices
from meshfit.distribution._layout_map import LayoutMap
from meshfit.distribution._mesh import DeviceMesh, TensorLayout
from meshfit.dtensor import AxisRole, ParallelDims
from meshfit.dtensor import LayoutMap as DTensorLayoutMap

DEFAULT_BATCH_DIM_NAME = "batch"


class Distribution:
    """The base of the distributions: a mesh, its data axis, and the strategy that trains on them.

    Args:
        device_mesh: a `DeviceMesh`.
        batch_dim_name: the mesh axis the batches are split over.
        auto_shard_dataset: split the dataset among the processes (meshfit always splits a batch
            over the data axis; False is kept for Keras code and changes nothing).
    """

    def __init__(self, device_mesh: DeviceMesh, batch_dim_name: str | None = None,
                 auto_shard_dataset: bool = True) -> None:
        self._device_mesh = device_mesh
        self._batch_dim_name = batch_dim_name
        self._dims = device_mesh.dims_for(batch_dim_name)  # refuses a data axis the mesh lacks
        self._auto_shard_dataset = auto_shard_dataset
        self._num_processes = _devices.num_processes()
        self._process_id = _devices.process_id()
        self._is_multi_process = self._num_processes > 1
        self._strategy: DistributionStrategy | None = None

    @property
    def num_processes(self) -> int:
        """Total number of processes in the cluster."""
        return self._num_processes

    @property
    def num_model_replicas(self) -> int:
        """Number of model replicas (the size of the data axis)."""
        raise NotImplementedError()

    @property
    def num_data_shards(self) -> int:
        """Total number of data shards."""
        return min(self.num_model_replicas, self.num_processes)

    @property
    def data_shard_id(self) -> int:
        """ID of the data shard for the current process."""
        num_model_replicas = self.num_model_replicas
        if num_model_replicas >= self.num_processes:
            return self._process_id
        processes_per_replica = self.num_processes // num_model_replicas
        return self._process_id // processes_per_replica

    def get_data_layout(self, data_shape: Any) -> TensorLayout:
        """Batches split on their first dim over ``batch_dim_name``, the rest whole (both subclasses)."""
        data_shard_spec: list[str | None] = [None] * len(data_shape)
        data_shard_spec[0] = self.batch_dim_name
        return TensorLayout(data_shard_spec, self.device_mesh)

    def _own_or(self, variable: Any, mapped: TensorLayout | None = None) -> TensorLayout:
        """A variable's explicit layout (Keras's ``_layout``), else ``mapped``, else replicated."""
        explicit = getattr(variable, "_layout", None)
        if explicit is not None:
            return explicit
        return mapped if mapped is not None else TensorLayout([None] * len(variable.shape), self.device_mesh)

    def get_variable_layout(self, variable: Any) -> TensorLayout:
        raise NotImplementedError()

    def get_tensor_layout(self, path: str) -> TensorLayout | None:
        raise NotImplementedError()

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Make this distribution current inside the block (the previous one again after it)."""
        original_scope = distribution()
        set_distribution(self)
        try:
            yield
        finally:
            set_distribution(original_scope)

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._device_mesh

    @property
    def batch_dim_name(self) -> str | None:
        return self._batch_dim_name

    @property
    def dims(self) -> ParallelDims:
        """The parallelism it trains with: the mesh's axes, ``batch_dim_name`` the data axis (`ParallelDims`)."""
        return self._dims

    @property
    def auto_shard_dataset(self) -> bool:
        return self._auto_shard_dataset

    @auto_shard_dataset.setter
    def auto_shard_dataset(self, auto_shard_dataset: bool) -> None:
        self._auto_shard_dataset = auto_shard_dataset

    def training_strategy(self) -> DistributionStrategy:
        """The ``mf.dtensor`` strategy that trains on this distribution (processes formed on first use)."""
        if self._strategy is None:
            self._strategy = self._make_strategy()
        return self._strategy

    def _make_strategy(self) -> DistributionStrategy:
        raise ValueError(f"Invalid distribution {self!r}: the base Distribution does not train a model. Use "
                         "DataParallel(...) or ModelParallel(layout_map=...).")

    def __repr__(self) -> str:
        return f"<{self.__class__.__name__} device_mesh={self.device_mesh}>"

    def __str__(self) -> str:
        return self.__repr__()


class DataParallel(Distribution):
    """Every weight replicated, each batch split over the mesh's first axis (``keras.distribution.DataParallel``).

    Give a `DeviceMesh` (its first axis is the data axis), or ``devices`` (a 1-D mesh ``("batch",)``),
    or neither (every device of `list_devices()`).

    Example:
        >>> distribution = DataParallel(devices=["cpu:0", "cpu:1"])
        >>> distribution.batch_dim_name
        'batch'
        >>> distribution.dims
        ParallelDims(batch=2:data)
    """

    def __init__(self, device_mesh: DeviceMesh | None = None, devices: Any = None,
                 auto_shard_dataset: bool = True) -> None:
        if device_mesh:
            if not isinstance(device_mesh, DeviceMesh):
                raise ValueError(f"Expect `mesh` to be an instance of `DeviceMesh`. Received: mesh={device_mesh} "
                                 f"(of type {type(device_mesh)})")
            super().__init__(device_mesh, device_mesh.axis_names[0], auto_shard_dataset)
            if self.device_mesh.devices.ndim != 1:
                warnings.warn(f"Expect the input mesh to be 1D, but received mesh.devices.ndim="
                              f"{device_mesh.devices.ndim}. The first axis will be used for data-parallel sharding.",
                              stacklevel=2)
            return
        devices = np.array(devices if devices else _devices.list_devices())
        device_mesh = DeviceMesh(shape=devices.shape, axis_names=[DEFAULT_BATCH_DIM_NAME], devices=devices)
        super().__init__(device_mesh, DEFAULT_BATCH_DIM_NAME, auto_shard_dataset)

    @property
    def num_model_replicas(self) -> int:
        return int(self.device_mesh.devices.size)

    def get_variable_layout(self, variable: Any) -> TensorLayout:
        return self._own_or(variable)

    def get_tensor_layout(self, path: str) -> None:
        return None

    def _make_strategy(self) -> DistributionStrategy:
        return self.device_mesh.mesh_for(self.batch_dim_name).strategy


class ModelParallel(Distribution):
    """Weights laid out by a `LayoutMap`, batches split over ``batch_dim_name`` (``keras.distribution.ModelParallel``).

    Args:
        layout_map: the `LayoutMap` (its mesh is the distribution's).
        batch_dim_name: the data axis (default: the mesh's first axis).
        auto_shard_dataset: see `Distribution`.
        device_mesh: accepted and ignored, as Keras 3 does (the mesh is the layout map's).

    Raises:
        ValueError: no `LayoutMap`, ``batch_dim_name`` or a layout's axis is not one of the mesh's, a
            layout names one axis twice, or more processes than replicas without dividing evenly.
    """

    def __init__(self, *, layout_map: LayoutMap | None = None, batch_dim_name: str | None = None,
                 auto_shard_dataset: bool = True, **kwargs: Any) -> None:
        kwargs.pop("device_mesh", None)
        if kwargs:
            raise TypeError(f"Invalid arguments for ModelParallel: {sorted(kwargs)}. Expected layout_map=..., "
                            "batch_dim_name=..., auto_shard_dataset=....")
        if layout_map is None:
            raise ValueError("You must specify a layout_map argument.")
        if isinstance(layout_map, DTensorLayoutMap):
            raise ValueError(f"Invalid `layout_map`: ModelParallel takes a meshfit.distribution.LayoutMap, received the "
                             f"meshfit.dtensor map {layout_map!r}. Create and fit the model inside "
                             "`with layout_map.scope():` (the DTensor spelling), or build "
                             "mf.distribution.LayoutMap(device_mesh) (mf.distribution.LayoutMap.fully_sharded(device_mesh) "
                             "for fully sharded data parallel) with the same keys.")
        if not isinstance(layout_map, LayoutMap):
            raise ValueError(f"Argument `layout_map` must be a `LayoutMap` instance. Received: layout_map={layout_map}")
        device_mesh = layout_map.device_mesh
        if device_mesh is None:
            raise ValueError("Invalid `layout_map`: it has no device_mesh. Create it as LayoutMap(device_mesh).")
        batch_dim_name = batch_dim_name or device_mesh.axis_names[0]
        _check_axes(layout_map, device_mesh, batch_dim_name)
        super().__init__(device_mesh, batch_dim_name, auto_shard_dataset)
        self._layout_map = layout_map
        if (self._is_multi_process and self.num_processes > self.num_model_replicas
                and self.num_processes % self.num_model_replicas != 0):
            raise ValueError("If `num_processes` is greater than `num_model_replicas`, `num_processes` must be "
                             f"divisible by `num_model_replicas`. Got num_processes={self.num_processes}, "
                             f"num_model_replicas={self.num_model_replicas}.")

    @property
    def num_model_replicas(self) -> int:
        mesh_batch_dim_index = list(self.device_mesh.axis_names).index(str(self.batch_dim_name))
        return int(self.device_mesh.shape[mesh_batch_dim_index])

    @property
    def dims(self) -> ParallelDims:
        """The mesh's axes, ``batch_dim_name`` the data axis, marked ``shard`` for a fully sharded map."""
        if self._layout_map.is_fully_sharded:
            return self._dims.with_role(str(self.batch_dim_name), AxisRole.SHARD)
        return self._dims

    def get_variable_layout(self, variable: Any) -> TensorLayout:
        """The layout of ``variable`` (anything with ``.path`` and ``.shape``): its own, its map entry, or replicated."""
        explicit = getattr(variable, "_layout", None)  # checked before the map, which may not hold the path
        return explicit if explicit is not None else self._own_or(variable, self._layout_map[variable.path])

    def get_tensor_layout(self, path: str) -> TensorLayout | None:
        return self._layout_map[path]

    def _make_strategy(self) -> DistributionStrategy:
        layout_map = self._layout_map.dtensor_layout_map(self.batch_dim_name)
        return layout_map.mesh.strategy.with_layout_map(layout_map)


def _check_axes(layout_map: LayoutMap, device_mesh: DeviceMesh, batch_dim_name: str) -> None:
    """Refuse a data axis or a layout axis the mesh lacks, and a layout that names one axis twice."""
    names = list(device_mesh.axis_names)
    if batch_dim_name not in names:
        raise ValueError(f"Invalid `batch_dim_name`: expected one of the DeviceMesh's axes {names}, received "
                         f"batch_dim_name={batch_dim_name!r}. Pass batch_dim_name={names[0]!r} (or another axis of "
                         "the mesh), or add that axis to the DeviceMesh.")
    for key, layout in layout_map.items():
        axes = [axis for axis in layout.axes if axis is not None]
        missing = [axis for axis in axes if axis not in names]
        if missing:
            raise ValueError(f"Invalid layout {layout.axes} for LayoutMap key {key!r}: it names axis {missing[0]!r}, "
                             f"which the DeviceMesh lacks (its axes are {names}). Use one of the mesh's axes or None "
                             "(unsharded), or add the axis to the DeviceMesh.")
        if layout_map.is_fully_sharded and batch_dim_name in axes:
            raise ValueError(f"Invalid layout {layout.axes} for LayoutMap key {key!r} in a LayoutMap.fully_sharded "
                             f"map: it names the data axis {batch_dim_name!r}, over which the map already shards every "
                             "weight. Split the weight over another axis (e.g. ('model', None)), or remove the key.")
        twice = next((axis for axis in axes if axes.count(axis) > 1), None)
        if twice is not None:
            raise ValueError(f"Invalid layout {layout.axes} for LayoutMap key {key!r}: it names axis {twice!r} twice; "
                             "a mesh axis splits only one dimension. Set all but one of them to None.")


def distribution() -> Any:
    """The current distribution (set by `set_distribution` or ``distribution.scope()``), or None."""
    return global_distribution()


def set_distribution(value: Distribution | None) -> None:
    """Make ``value`` the global distribution: models created and fitted outside every strategy scope
    train on it (None: back to the default strategy).

    Raises:
        ValueError: ``value`` is not a distribution.
    """
    if value is not None and not isinstance(value, Distribution):
        raise ValueError(f"Invalid distribution: expected a DataParallel or ModelParallel, received {value!r}.")
    set_global_distribution(value)
