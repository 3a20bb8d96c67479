"""Fully sharded data parallel: ``LayoutMap.fully_sharded(mesh)`` on torch's ``fully_shard`` (FSDP2).

On a 2-D mesh ``[("batch", B), ("model", M)]``, the map's keys split their weights over ``model``
first (`meshfit.dtensor._tensor_parallel`), then every weight is sharded over ``batch`` (on the
``batch`` sub-mesh), as torchtitan composes FSDP2 with tensor parallelism: a placement is a
`PlacementPlan` of those two transforms, then the gradient sync that remains (none), built by
`meshfit.distribute`'s one plan builder.

Every weight is split over the mesh's data axis, ``batch`` here (ZeRO-3; the data axis is whichever
axis has the data role, ``mesh.dims.data_axis``, and the map's `dims` mark it ``shard``): each process
keeps 1/N of the parameters, their gradients and the optimizer state. ``fully_shard`` runs per
block (the names the user gave, else the direct children that hold parameters), then on the root,
so a block's weights are all-gathered in one bucket just before its forward/backward (with
prefetch) and its gradients reduce-scattered in one bucket after its backward.

A module built on the meta device (``with torch.device("meta"): module = build()``) is never
materialised whole: each block in turn gets storage, ``reset_parameters()`` and rank 0's values, and
is sharded before the next one, so a process holds at most one block's full weights (`_materialise`).

Gradients (`FullyShardedSync`): FSDP reduces them in the backward, so no optimizer reduces them
again (the placement's plan answers `gradient_reduced` for every parameter it placed). The reduce-scatter
goes through `_WeightedReduceScatter`, which scales each process's bucket before FSDP's average:

- inside ``fit``'s step by ``local * N / global`` (the strategy's ``batch_weight``): the average is
  then the gradient of the global batch's mean loss also for a last, uneven batch, as DDP's hook does;
- outside ``fit`` (a custom loop) by ``N``: the replicas' gradients are summed, TF's contract with
  ``compute_average_loss``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from meshfit.distribute import (
    DataParallelSync,
    GradientWeight,
    Placement,
    ReplicatedSync,
    Transform,
    World,
    place_sharded,
)
from meshfit.dtensor._tensor_parallel import TensorParallel, tensor_parallel_styles


@dataclasses.dataclass
class FullyShardedSync(ReplicatedSync):
    """FSDP's reduce-scatter, weighted by the step's batch shares; see the module docstring."""

    weight: GradientWeight
    replicas: int

    def weighting(self, local_size: int, global_size: int) -> contextlib.AbstractContextManager[None]:
        return DataParallelSync.weighting_of(self.weight, self.replicas, local_size, global_size)

    def in_step(self) -> bool:
        return True  # the module is the sharded module: every forward runs through FSDP

    def reduced(self, param: torch.Tensor) -> bool:
        return True  # FSDP reduce-scatters every gradient in the backward, inside fit or not


def _weighted_reduce_scatter(weight: GradientWeight, replicas: int) -> Any:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class _WeightedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            factor = weight.factor if weight.in_step else float(replicas)
            if factor != 1.0:
                input_tensor.mul_(factor)
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    return _WeightedReduceScatter()


@dataclasses.dataclass
class FullyShard:
    """The plan's transform over ``batch``: ``fully_shard`` per block, then on the root (see the module
    docstring); a meta-device model is materialised block by block just before its block is sharded."""

    batch_mesh: Any
    world: World
    blocks: list[str]
    on_meta: bool
    weight: GradientWeight
    replicas: int
    name: str = "fully_shard"

    def apply(self, module: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        for name in self.blocks:
            block = module.get_submodule(name)
            if self.on_meta:  # one block's full weights at a time: materialise, initialise, rank 0's values, shard
                _materialise(block, self.world)
            fully_shard(block, mesh=self.batch_mesh).set_custom_reduce_scatter(
                _weighted_reduce_scatter(self.weight, self.replicas))
        if self.on_meta:
            _materialise(module, self.world, skip=self.blocks)
        fully_shard(module, mesh=self.batch_mesh).set_custom_reduce_scatter(
            _weighted_reduce_scatter(self.weight, self.replicas))
        return module


def fully_shard_module(module: nn.Module, layout_map: Any, world: World, batch_axis: str | None,
                       weight: GradientWeight) -> Placement:
    """Place ``module`` by its plan: tensor-parallel layouts (keyed weights), then ``fully_shard`` over
    ``batch``; FSDP then reduces every gradient (no sync remains for the optimizer step).

    Raises:
        ValueError: the mesh has no ``batch`` axis, a key is bad (see `tensor_parallel_styles`), a key
            matches nothing, a named block does not exist, a parameter is shared between blocks, or a
            module built on the meta device has no ``reset_parameters()`` (or has keyed weights).
    """
    mesh = layout_map.mesh
    if batch_axis is None:
        raise ValueError(f"Invalid mesh for LayoutMap.fully_sharded: expected a mesh with a data axis (an axis "
                         f"named 'batch', or one given the role 'data'), received {mesh!r}. Create it with "
                         "mf.dtensor.create_mesh([('batch', N)]) or [('batch', B), ('model', M)].")
    _check_keys(module, layout_map)
    axis, styles = tensor_parallel_styles(module, layout_map, batch_axis)
    blocks = _blocks(module, layout_map.blocks)
    _check_not_shared(module, blocks)
    on_meta = _check_meta(module)
    if on_meta and styles:
        raise ValueError(f"Invalid meta-device module for a LayoutMap.fully_sharded map with keys over {axis!r}: "
                         "tensor-parallel weights of a meta-device model are not supported yet. Build the model "
                         "outside torch.device('meta'), or remove the keys.")
    if not on_meta:
        world.broadcast_tensors([*module.parameters(), *module.buffers()])  # rank 0's initial weights
    replicas = mesh.dim_size(batch_axis)
    transforms: list[Transform] = []
    if axis is not None and mesh.dim_size(axis) > 1:
        transforms.append(TensorParallel(axis, styles, world.sub_mesh(axis)))
    transforms.append(FullyShard(world.sub_mesh(batch_axis), world, blocks, on_meta, weight, replicas))
    return place_sharded(module, transforms, FullyShardedSync(weight, replicas))


def _check_keys(module: nn.Module, layout_map: Any) -> None:
    """Refuse a key that matches no parameter: it shards nothing (a hand layout is refused above)."""
    paths = [path for path, _ in module.named_parameters(remove_duplicate=False)]  # a tie's every path
    unmatched = layout_map.unmatched_keys(paths)
    if unmatched:
        raise ValueError(f"Invalid LayoutMap key {unmatched[0]!r} in a LayoutMap.fully_sharded map: expected a weight "
                         f"path or regular expression matching a parameter of {type(module).__name__} (e.g. "
                         f"{_few(paths)}), received {unmatched[0]!r}, which matches none. The map already shards "
                         f"every weight over 'batch': remove the key (del layout_map[{unmatched[0]!r}]).")


def _few(names: list[str], count: int = 6) -> str:
    return repr(names[:count])[:-1] + (", ...]" if len(names) > count else "]")


def _materialise(module: nn.Module, world: World, skip: Sequence[str] = ()) -> None:
    """Storage, ``reset_parameters()`` and rank 0's values for the meta tensors outside ``skip``.

    Module by module in ``named_modules()`` order, the order ``__init__`` ran ``reset_parameters`` in
    an eager build: with the same seed the values equal the eager build's.

    A tied parameter (one meta tensor held by two modules) is materialised by the first module that
    holds it; a later holder still runs its ``reset_parameters()`` (drawing what the eager build drew
    before the tie replaced its own weight), then gets the first one's tensor back, so the tie stays.
    """
    device = world.device
    made: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id -> (meta parameter kept alive, its tensor)
    for path, sub in module.named_modules():
        if any(path == b or path.startswith(b + ".") for b in skip):
            continue
        tied = {name: made[id(p)][1] for name, p in sub._parameters.items() if p is not None and id(p) in made}
        if _has_meta(sub):
            before = dict(sub._parameters)
            sub.to_empty(device=device, recurse=False)
            sub.reset_parameters()  # checked by _check_meta
            for name, param in sub._parameters.items():
                if param is not None and name not in tied:
                    made[id(before[name])] = (before[name], param)
            world.broadcast_tensors([p for name, p in sub._parameters.items() if p is not None and name not in tied]
                                    + list(sub.buffers(recurse=False)))
        for name, param in tied.items():
            sub.register_parameter(name, param)


def _has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)])


def _check_meta(module: nn.Module) -> bool:
    """Whether ``module`` was built on the meta device; refuses one that could not be initialised."""
    on_meta = False
    for path, sub in module.named_modules():
        if _has_meta(sub):
            on_meta = True
            if not callable(getattr(sub, "reset_parameters", None)):
                raise ValueError(f"Invalid meta-device module for LayoutMap.fully_sharded: expected every module "
                                 f"with weights to have reset_parameters(), received {path or 'the root'!r} "
                                 f"({type(sub).__name__}) without one. Give it reset_parameters(), or build the "
                                 "model outside torch.device('meta').")
    return on_meta


def _blocks(module: nn.Module, names: Sequence[str] | None) -> list[str]:
    """The named blocks (checked), else the direct children that hold parameters."""
    if names is None:
        return _default_blocks(module)
    found = dict(module.named_modules())
    for name in names:
        if not name or name not in found:
            holders = [n for n, child in found.items() if n and any(True for _ in child.parameters())]
            params = [path for path, _ in module.named_parameters()]
            raise ValueError(f"Invalid block {name!r} in LayoutMap.fully_sharded(blocks=...): expected a submodule "
                             f"path of {type(module).__name__} that holds parameters (e.g. {_few(holders)}; its "
                             f"parameters are {_few(params)}), received {name!r}, which names no submodule. Name "
                             "submodules (module.named_modules() names, not parameter paths), or leave blocks=None to "
                             "shard each direct child that holds parameters.")
    return list(names)


def _default_blocks(module: nn.Module, prefix: str = "") -> list[str]:
    """The direct children that hold parameters; a ``ModuleList``/``ModuleDict`` (no forward of its own,
    which ``fully_shard`` refuses) stands for its children: a transformer's layers are one block each."""
    blocks = []
    for name, child in module.named_children():
        if not any(True for _ in child.parameters()):
            continue
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            blocks.extend(_default_blocks(child, f"{prefix}{name}."))
        else:
            blocks.append(prefix + name)
    return blocks


def _check_not_shared(module: nn.Module, blocks: list[str]) -> None:
    """Refuse a parameter reachable from two blocks (or from a block and outside every block)."""
    owners: dict[int, dict[str, str]] = {}
    for path, param in module.named_parameters(remove_duplicate=False):
        owner = next((b for b in blocks if path.startswith(b + ".")), "")
        owners.setdefault(id(param), {}).setdefault(owner, path)
    for by_owner in owners.values():
        if len(by_owner) > 1:
            paths = list(by_owner.values())
            where = [f"block {o!r}" if o else "the root (outside every block)" for o in by_owner]
            raise ValueError(f"Parameter {paths[0]!r} is shared with {paths[1]!r} ({where[0]} and {where[1]}): "
                             "fully_shard cannot shard one parameter in two units. Name blocks that keep its uses "
                             "together, e.g. LayoutMap.fully_sharded(mesh, blocks=[]) to shard the model as one "
                             "unit, or untie the parameter.")
