"""Tensor parallelism inside pipeline stages: a map's keys split a stage's weights over the tensor axis.

On a mesh ``[("pipe", P), ("batch", B), ("model", M)]`` a pipeline's stages run on the ``model``
sub-mesh of their processes. Each weight of a stage becomes a DTensor on that sub-mesh: split as its
key's layout says (``Layout(["model", UNSHARDED], mesh)``: rows split), replicated when no key matches.
The traced graph of a stage is torch ATen code, not the user's modules, so torch's tensor-parallel
styles (module hooks) do not apply; instead the stage's unit runs its graph on DTensors (its inputs
replicated over ``model``), and DTensor's sharding propagation computes each operation as one
process would, communicating where a split requires it. The stage's outputs leave it whole.

Then, over the data axis, the stages are replicated or fully sharded as without a tensor axis
(``fully_shard`` over ``batch`` composes with the weights' ``model`` layouts as torchtitan's 2-D
parallelism does).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from meshfit.dtensor._attention_sharding import register_attention_sharding
from meshfit.dtensor._layout import UNSHARDED


def tensor_axis_of(mesh: Any, pipeline: str, data: str | None) -> str | None:
    """The mesh's one tensor axis beside its pipeline and data axes (None: there is none).

    Raises:
        ValueError: the mesh has two or more other axes.
    """
    others = [a for a in mesh.axis_names if a not in (pipeline, data)]
    if len(others) > 1:
        raise ValueError(f"Invalid pipeline on {mesh!r}: beside the pipeline axis {pipeline!r} and the data axis "
                         f"{data!r} a pipeline takes one tensor axis, received {others}. Use a mesh such as "
                         "create_mesh([('pipe', 2), ('batch', 2), ('model', 2)]).")
    return others[0] if others else None


def check_stage_layouts(module: nn.Module, layout_map: Any, axis: str) -> None:
    """Refuse a key whose layout names another axis than ``axis`` (or has another rank than its weight), for
    every weight of every stage: each process checks them all, so every process refuses together."""
    for path, param in module.named_parameters(remove_duplicate=False):
        _placement(path, param, layout_map, axis)


def _placement(path: str, param: torch.Tensor, layout_map: Any, axis: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    layout = layout_map[path] if layout_map is not None and len(layout_map) else None
    if layout is None:
        return Replicate()
    named = [(dim, spec) for dim, spec in enumerate(layout.sharding_specs) if spec != UNSHARDED]
    if any(spec != axis for _, spec in named) or layout.rank != param.dim():
        raise ValueError(f"Invalid layout {list(layout.sharding_specs)} for {path!r} (shape {tuple(param.shape)}) "
                         f"inside a pipeline stage: a stage's weights split over the tensor axis {axis!r} only, one "
                         f"entry per dim. Use e.g. Layout([{axis!r}, UNSHARDED], mesh), or UNSHARDED for the other "
                         "axes.")
    return Shard(named[0][0]) if named else Replicate()


def lay_out_stage(module: nn.Module, paths: Iterable[str], layout_map: Any, axis: str, sub_mesh: Any) -> None:
    """Make each parameter of ``paths`` a DTensor on ``axis``'s ``sub_mesh``: split as ``layout_map``'s key
    for it says, else replicated (`check_stage_layouts` first). A weight tied within the stage takes its
    first path's layout, and its paths' keys must agree."""
    from torch.distributed.tensor import distribute_tensor

    register_attention_sharding()  # SDPA on a CPU inside a split stage
    made: dict[int, tuple[nn.Parameter, str, Any]] = {}  # a weight tied within the stage stays one parameter
    for path in sorted(paths):
        owner, _, name = path.rpartition(".")
        holder = module.get_submodule(owner)
        param = holder._parameters.get(name)
        if param is None:
            continue  # a buffer: the same on every process of the stage
        placement = _placement(path, param, layout_map, axis)
        if id(param) in made:
            tied, first, first_placement = made[id(param)]
            if placement != first_placement:
                raise ValueError(f"Invalid layouts for the tied weight {first!r} and {path!r}: the keys give "
                                 f"{first_placement} and {placement} on {axis!r}. One weight has one layout: key "
                                 "both paths alike, or one of them.")
            holder._parameters[name] = tied
            continue
        laid_out = distribute_tensor(param.detach(), sub_mesh, [placement])
        tied = nn.Parameter(laid_out, requires_grad=param.requires_grad)
        holder._parameters[name] = tied
        made[id(param)] = (tied, path, placement)
