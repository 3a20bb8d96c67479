"""Fully sharded data parallel: ``LayoutMap.fully_sharded(mesh)`` on torch's ``fully_shard`` (FSDP2).

Every weight is split over the mesh's ``batch`` axis, the data-parallel axis (ZeRO-3): each process
keeps 1/N of the parameters, their gradients and the optimizer state. ``fully_shard`` runs per
block (the names the user gave, else the direct children that hold parameters), then on the root,
so a block's weights are all-gathered in one bucket just before its forward/backward (with
prefetch) and its gradients reduce-scattered in one bucket after its backward.

A module built on the meta device (``with torch.device("meta"): module = build()``) is never
materialised whole: each block in turn gets storage, ``reset_parameters()`` and rank 0's values, and
is sharded before the next one, so a process holds at most one block's full weights (`_materialise`).

Gradients (`FullyShardedSync`): FSDP reduces them in the backward, so no optimizer reduces them
again (the parameters are marked reduced by a forward pre-hook, as DDP's are). The reduce-scatter
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
import torch.distributed as dist
from torch import nn

from meshfit.distribute import DataParallelSync, GradientWeight, Placement, ReplicatedSync, mark_reduced


@dataclasses.dataclass
class FullyShardedSync(ReplicatedSync):
    """FSDP's reduce-scatter, weighted by the step's batch shares; see the module docstring."""

    weight: GradientWeight
    replicas: int

    def install(self, root: nn.Module) -> None:
        """Mark the root's (sharded) parameters as reduced whenever it runs a forward with grad on."""
        def pre_hook(module: nn.Module, args: Any) -> None:
            if torch.is_grad_enabled():
                mark_reduced([p for p in module.parameters() if p.requires_grad])

        pre_hook.meshfit_placement = True  # type: ignore[attr-defined]  # saving: no math changes here
        root.register_forward_pre_hook(pre_hook)

    def weighting(self, local_size: int, global_size: int) -> contextlib.AbstractContextManager[None]:
        return DataParallelSync.weighting_of(self.weight, self.replicas, local_size, global_size)

    def in_step(self) -> bool:
        return True  # the module is the sharded module: every forward runs through FSDP


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


def fully_shard_module(module: nn.Module, layout_map: Any, device_mesh: Any, batch_axis: str | None,
                       weight: GradientWeight) -> Placement:
    """Shard ``module`` in place with ``fully_shard`` per block then on the root; see the module docstring.

    Raises:
        ValueError: the mesh has no ``batch`` axis or other axes, a weight also has a hand layout,
            a named block does not exist, a parameter is shared between blocks, or a module built on the
            meta device has no ``reset_parameters()``.
    """
    from torch.distributed.fsdp import fully_shard

    mesh = layout_map.mesh
    if batch_axis is None or len(mesh.axis_names) != 1:
        raise ValueError(f"Invalid mesh for LayoutMap.fully_sharded: expected a 1-D mesh with a 'batch' axis, "
                         f"received {mesh!r}. Create it with mf.dtensor.create_mesh([('batch', N)]); combining "
                         "full sharding with 'model' axis layouts is not supported yet.")
    for path, _ in module.named_parameters():
        if layout_map[path] is not None:
            raise ValueError(f"Parameter {path!r} has a hand layout ({layout_map[path].sharding_specs}) in a "
                             "LayoutMap.fully_sharded map, which already shards every weight over 'batch'. Remove "
                             f"the key that matches {path!r}, or use a plain mf.dtensor.LayoutMap(mesh) for "
                             "hand layouts.")
    _check_keys(module, layout_map)
    blocks = _blocks(module, layout_map.blocks)
    _check_not_shared(module, blocks)
    on_meta = _check_meta(module)
    if not on_meta:
        _broadcast_from_rank0(module, device_mesh)
    replicas = mesh.dim_size(batch_axis)
    for name in blocks:
        block = module.get_submodule(name)
        if on_meta:  # one block's full weights at a time: materialise, initialise, rank 0's values, shard
            _materialise(block, device_mesh)
        fully_shard(block, mesh=device_mesh).set_custom_reduce_scatter(
            _weighted_reduce_scatter(weight, replicas))
    if on_meta:
        _materialise(module, device_mesh, skip=blocks)
    fully_shard(module, mesh=device_mesh).set_custom_reduce_scatter(_weighted_reduce_scatter(weight, replicas))
    sync = FullyShardedSync(weight, replicas)
    sync.install(module)
    return Placement(module, module, sync)


def _check_keys(module: nn.Module, layout_map: Any) -> None:
    """Refuse a key that matches no parameter: it shards nothing (a hand layout is refused above)."""
    paths = [path for path, _ in module.named_parameters()]
    unmatched = layout_map.unmatched_keys(paths)
    if unmatched:
        raise ValueError(f"Invalid LayoutMap key {unmatched[0]!r} in a LayoutMap.fully_sharded map: expected a weight "
                         f"path or regular expression matching a parameter of {type(module).__name__} (e.g. "
                         f"{_few(paths)}), received {unmatched[0]!r}, which matches none. The map already shards "
                         f"every weight over 'batch': remove the key (del layout_map[{unmatched[0]!r}]).")


def _few(names: list[str], count: int = 6) -> str:
    return repr(names[:count])[:-1] + (", ...]" if len(names) > count else "]")


def _materialise(module: nn.Module, device_mesh: Any, skip: Sequence[str] = ()) -> None:
    """Storage, ``reset_parameters()`` and rank 0's values for the meta tensors outside ``skip``.

    Module by module in ``named_modules()`` order, the order ``__init__`` ran ``reset_parameters`` in
    an eager build: with the same seed the values equal the eager build's.

    """
    device = torch.device(device_mesh.device_type)
    for path, sub in module.named_modules():
        if any(path == b or path.startswith(b + ".") for b in skip):
            continue
        if _has_meta(sub):
            sub.to_empty(device=device, recurse=False)
            sub.reset_parameters()  # checked by _check_meta
            _broadcast_from_rank0(sub, device_mesh, recurse=False)


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
        return [name for name, child in module.named_children() if any(True for _ in child.parameters())]
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


def _broadcast_from_rank0(module: nn.Module, device_mesh: Any, recurse: bool = True) -> None:
    """Rank 0's initial weights on every process (each then keeps its shard)."""
    if device_mesh.size() == 1:
        return
    group = device_mesh.get_group()
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]:
            dist.broadcast(tensor.data, src=src, group=group)
