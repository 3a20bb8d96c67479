"""`pack`, `unpack`, `copy_to_mesh`: plain tensors in and out of DTensors with a `Layout`.

TensorFlow's single client holds every local device's component; here each device is its own
process, so `pack` takes this host's components (one per local mesh device, as the seed's
``tf.split(x, mesh.num_local_devices())`` makes them) and keeps the one of this process's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from meshfit._lazy_dtensor import is_dtensor
from meshfit.data import map_structure
from meshfit.distribute import data_axis_of, process_world
from meshfit.dtensor._layout import Layout


def _check_layout(layout: Any) -> Layout:
    if not isinstance(layout, Layout):
        raise TypeError(f"Invalid `layout`: expected a meshfit.dtensor.Layout, received layout={layout!r}.")
    return layout


def pack(components: Sequence[torch.Tensor], layout: Layout) -> Any:
    """A DTensor with ``layout`` from the components of this host's mesh devices.

    Args:
        components: one tensor per local mesh device (``layout.mesh.num_local_devices()``), in
            local device order; each is that device's shard. A single tensor is accepted as this
            process's own shard.
        layout: the layout of the packed tensor.

    Returns:
        A ``torch.distributed.tensor.DTensor`` whose local shard is this process's component.

    Raises:
        ValueError: the number of components is not the number of local devices, their shapes
            differ (shards must be even), or their rank is not the layout's.
    """
    from torch.distributed.tensor import DTensor

    layout = _check_layout(layout)
    mesh = layout.mesh
    if isinstance(components, torch.Tensor):
        components = [components]
    components = list(components)
    local = mesh.num_local_devices()
    if len(components) not in (1, local) or not components:
        raise ValueError(f"Invalid `components`: expected {local} tensors (one per local device of "
                         f"{mesh!r}), received {len(components)}. Split the local batch with "
                         f"tensor_split(x, mesh.num_local_devices()).")
    shapes = {tuple(c.shape) for c in components}
    if len(shapes) > 1:
        raise ValueError(f"Invalid `components`: shards must be even, received shapes {sorted(shapes)}. Use a "
                         f"batch size divisible by {len(components)}.")
    mine = components[mesh.local_device_index() if len(components) > 1 else 0]
    if mine.dim() != layout.rank:
        raise ValueError(f"Invalid `components`: the layout {list(layout.sharding_specs)} has rank {layout.rank}, "
                         f"received tensors of rank {mine.dim()} (shape {list(mine.shape)}).")
    return DTensor.from_local(mine, mesh.device_mesh, list(layout.placements), run_check=False)


def unpack(tensor: Any) -> list[torch.Tensor]:
    """This process's component of a DTensor, as a one-element list (one local device per process)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        raise TypeError(f"Invalid `tensor`: expected a DTensor (from pack or copy_to_mesh), received "
                        f"{type(tensor).__name__}.")
    return [tensor.to_local()]


def copy_to_mesh(tensor: Any, layout: Layout) -> Any:
    """A DTensor with ``layout`` holding the full ``tensor`` (every process passes the same value)."""
    from torch.distributed.tensor import distribute_tensor

    layout = _check_layout(layout)
    tensor = torch.as_tensor(tensor)
    layout.check_shape(tensor.shape, "the tensor")
    return distribute_tensor(tensor, layout.mesh.device_mesh, list(layout.placements), src_data_rank=None)


def local_rows(tensor: Any) -> torch.Tensor:
    """This process's rows of a DTensor: split over its mesh's data axis, whole along the others."""
    mesh = tensor.device_mesh
    placements = batch_placements(mesh, tensor.dim())
    if tuple(tensor.placements) != tuple(placements):
        tensor = tensor.redistribute(mesh, placements)
    return tensor.to_local()


def batch_placements(device_mesh: Any, rank: int) -> list[Any]:
    """The placements of a batch of ``rank`` dims on ``device_mesh``: rows split over its data axis (the
    axis whose role is data parallel, `data_axis`), replicated along the others and for a scalar."""
    from torch.distributed.tensor import Replicate, Shard

    axis = data_axis(device_mesh)
    names = device_mesh.mesh_dim_names or ()
    return [Shard(0) if name == axis and rank > 0 else Replicate() for name in names] \
        or [Replicate()] * device_mesh.ndim


def data_axis(device_mesh: Any) -> str | None:
    """The data axis among a torch ``DeviceMesh``'s axes, by the roles of the world that formed it (by
    the names' roles for a mesh meshfit did not form); None when none splits the batches."""
    world = process_world()
    return data_axis_of(device_mesh, world.dims if world is not None else None)


def local_rows_of(structure: Any) -> tuple[Any, Any]:
    """``structure`` with each DTensor leaf made this process's rows (`local_rows`), and the first such leaf's
    mesh (None when no leaf is a DTensor)."""
    meshes: list[Any] = []

    def to_local(leaf: Any) -> Any:
        if not is_dtensor(leaf):
            return leaf
        meshes.append(leaf.device_mesh)
        return local_rows(leaf)

    converted = map_structure(to_local, structure)
    return converted, meshes[0] if meshes else None


def batch_dtensors(structure: Any, mesh: Any) -> tuple[Any, bool]:
    """``structure`` with each plain tensor leaf made a DTensor of this process's rows on ``mesh`` (split over its
    data axis: `batch_placements`), and whether any leaf was."""
    converted = False

    def to_dtensor(leaf: Any) -> Any:
        nonlocal converted
        if not isinstance(leaf, torch.Tensor) or is_dtensor(leaf):
            return leaf
        from torch.distributed.tensor import DTensor

        converted = True
        return DTensor.from_local(leaf, mesh, batch_placements(mesh, leaf.dim()), run_check=False)

    return map_structure(to_dtensor, structure), converted
