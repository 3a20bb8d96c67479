"""`LayoutMap`: Keras 3's map of `TensorLayout` by weight path (regular expressions matching whole paths)."""

from __future__ import annotations

import collections
import re
from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

from meshfit.distribution._mesh import DeviceMesh, TensorLayout
from meshfit.dtensor import LayoutMap as DTensorLayoutMap


class LayoutMap(MutableMapping):
    """A dict of `TensorLayout` by weight path, as ``keras.distribution.LayoutMap``.

    A lookup tries the exact key, then every key as a regular expression that must match the
    whole path (``re.fullmatch``); a path that several keys match is an error. The paths are the
    module's parameter paths (``named_parameters()``: ``dense.weight``, ``0.bias``). A tuple of
    axis names is a shortcut for a `TensorLayout`.

    Args:
        device_mesh: the `DeviceMesh` of the layouts (set on those inserted without one).

    Example:
        >>> mesh = DeviceMesh((2, 4), ["batch", "model"], [f"cpu:{i}" for i in range(8)])
        >>> layout_map = LayoutMap(mesh)
        >>> layout_map[".*dense.*weight"] = ("model", None)
        >>> layout_map["dense_1.weight"].axes
        ('model', None)
    """

    def __init__(self, device_mesh: DeviceMesh | None) -> None:
        self._layout_map: collections.OrderedDict[str, TensorLayout] = collections.OrderedDict()
        self._device_mesh = device_mesh
        self.is_fully_sharded = False
        self.blocks: list[str] | None = None
        self._pipeline: tuple[tuple[str, ...], int, str, int] | None = None

    def pipeline(self, split_points: Sequence[str], microbatches: int, schedule: str = "1F1B",
                 stages_per_rank: int = 1) -> LayoutMap:
        """Split the model into pipeline stages along the mesh's ``"pipe"`` axis; returns the map.

        The same placement as ``mf.dtensor.LayoutMap.pipeline`` (see it for the arguments): give the map
        to ``ModelParallel(layout_map=..., batch_dim_name=...)`` on a `DeviceMesh` with a ``"pipe"`` axis.

        Example:
            >>> mesh = DeviceMesh((2, 2), ["pipe", "batch"], [f"cpu:{i}" for i in range(4)])
            >>> layout_map = LayoutMap(mesh).pipeline(["blocks.2"], microbatches=4)
            >>> layout_map
            LayoutMap({}, device_mesh=<DeviceMesh shape=(2, 2), axis_names=['pipe', 'batch']>).pipeline(['blocks.2'], microbatches=4, schedule='1F1B')
        """
        DTensorLayoutMap().pipeline(split_points, microbatches, schedule, stages_per_rank)  # its checks, now
        self._pipeline = (tuple(split_points), microbatches, schedule, stages_per_rank)
        return self

    @classmethod
    def fully_sharded(cls, device_mesh: DeviceMesh, blocks: Sequence[str] | None = None) -> LayoutMap:
        """A map that shards every weight over the data axis: fully sharded data parallel (ZeRO-3, FSDP2).

        The same placement as ``mf.dtensor.LayoutMap.fully_sharded``: each process keeps 1/N of the
        parameters, gradients and optimizer state (N: the size of ``ModelParallel``'s
        ``batch_dim_name`` axis). Keys added to it split their weights over another axis (tensor
        parallel, e.g. ``layout_map["attn.qkv.weight"] = ("model", None)``) before the sharding over
        the data axis. Give it to ``ModelParallel(layout_map=...)``.

        Args:
            device_mesh: the `DeviceMesh`, e.g. ``DeviceMesh((4,), ["batch"])`` or ``(2, 2)`` with
                ``["batch", "model"]``.
            blocks: submodule paths to shard as one unit each (default: the model's direct children
                that hold parameters; see ``mf.dtensor.LayoutMap.fully_sharded``).

        Example:
            >>> mesh = DeviceMesh((2, 2), ["batch", "model"], [f"cpu:{i}" for i in range(4)])
            >>> layout_map = LayoutMap.fully_sharded(mesh)
            >>> layout_map["mlp.fc1.weight"] = ("model", None)
            >>> layout_map.is_fully_sharded
            True
        """
        if not isinstance(device_mesh, DeviceMesh):
            raise ValueError(f"Invalid `device_mesh`: expected a meshfit.distribution.DeviceMesh, received "
                             f"device_mesh={device_mesh!r}. Create one with DeviceMesh(shape, axis_names).")
        if blocks is not None and (isinstance(blocks, str) or not all(isinstance(b, str) for b in blocks)):
            raise TypeError(f"Invalid `blocks`: expected a list of submodule paths (str), received blocks={blocks!r}.")
        layout_map = cls(device_mesh)
        layout_map.is_fully_sharded = True
        layout_map.blocks = None if blocks is None else list(blocks)
        return layout_map

    def __getitem__(self, key: str) -> Any:
        """The layout of path ``key``: the exact key, else the one key that fully matches, else None.

        Raises:
            ValueError: several keys match ``key``.
        """
        if key in self._layout_map:
            return self._layout_map[key]
        matching_keys = [pattern for pattern in self._layout_map if re.fullmatch(pattern, key)]
        if len(matching_keys) > 1:
            raise ValueError(f"Path '{key}' matches multiple layout specification keys: {matching_keys}. Please "
                             "make sure each tensor/variable path only matches at most one layout specification "
                             "key in the LayoutMap.")
        if len(matching_keys) == 1:
            return self._layout_map[matching_keys[0]]
        return None

    def __setitem__(self, key: str, layout: Any) -> None:
        if key in self._layout_map:
            raise ValueError(f"{key} already exist in the LayoutMap with value {self._layout_map[key]}. Please make "
                             f"sure to not use duplicated keys: delete it first (del layout_map[{key!r}]) to "
                             "replace it.")
        if isinstance(layout, tuple):
            layout = TensorLayout(axes=layout, device_mesh=None)
        if not isinstance(layout, TensorLayout):
            raise ValueError(f"{layout} should be a TensorLayout type, got {type(layout)}")
        if layout.device_mesh is None and self._device_mesh is not None:
            layout.device_mesh = self._device_mesh
        self._layout_map[key] = layout

    def __delitem__(self, key: str) -> None:
        self._layout_map.pop(key)

    def __len__(self) -> int:
        return len(self._layout_map)

    def __iter__(self) -> Iterator[str]:
        return iter(self._layout_map)

    @property
    def device_mesh(self) -> DeviceMesh | None:
        return self._device_mesh

    def dtensor_layout_map(self, batch_dim_name: str | None) -> DTensorLayoutMap:
        """This map as a ``meshfit.dtensor.LayoutMap`` (whole-path matching) on the mesh's processes."""
        if self._device_mesh is None:
            raise ValueError("Invalid LayoutMap: it has no device_mesh. Create it as LayoutMap(device_mesh).")
        mesh = self._device_mesh.mesh_for(batch_dim_name)
        if self.is_fully_sharded:
            converted = DTensorLayoutMap.fully_sharded(mesh, self.blocks)
            converted.match = "fullmatch"
        else:  # the weights a tensor-parallel style can split run it, as a fully sharded map's keys do
            converted = DTensorLayoutMap(mesh, match="fullmatch")
            converted.tensor_parallel_first = True
        for key, layout in self._layout_map.items():
            converted[key] = layout.layout_for(batch_dim_name)
        if self._pipeline is not None:
            split_points, microbatches, schedule, stages_per_rank = self._pipeline
            converted.pipeline(split_points, microbatches, schedule, stages_per_rank)
        return converted

    def __repr__(self) -> str:
        items = ", ".join(f"{key!r}: {layout.axes}" for key, layout in self._layout_map.items())
        kind = "LayoutMap.fully_sharded" if self.is_fully_sharded else "LayoutMap"
        text = f"{kind}({{{items}}}, device_mesh={self._device_mesh})"
        if self._pipeline is not None:
            points, microbatches, schedule, per_rank = self._pipeline
            text += f".pipeline({list(points)!r}, microbatches={microbatches}, schedule={schedule!r}" + \
                (f", stages_per_rank={per_rank})" if per_rank != 1 else ")")
        return text
