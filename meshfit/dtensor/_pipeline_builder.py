"""Placing a module as pipeline stages: the `PlacementBuilder` of ``layout_map.pipeline(...)``.

The mesh has a pipeline axis and, optionally, a data axis and a tensor axis (the map's keys split a
stage's weights over it: `meshfit.dtensor._stage_layouts`). Along the data axis each stage is
replicated (a plain map: the step runner all-reduces the stage's gradients by rows) or fully sharded
(``LayoutMap.fully_sharded(mesh).pipeline(...)``: each stage's unit goes through torch's
``fully_shard`` over the data axis, as torchtitan applies FSDP to each stage, so a process keeps its
stage's share of the parameters, gradients and optimizer state).

Replicas start from rank 0's weights (one broadcast of the module before it is split). A process keeps
only its stages' parameters: the others' become `ReleasedParameter`s (their shapes, one element of
memory each), and what reads their values takes them from their holders.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshfit.distribute import (
    GradientWeight,
    Placement,
    StageResidency,
    broadcast_initial_values,
    place_staged,
    release_unheld,
    untracked,
)
from meshfit.dtensor._fully_sharded import _weighted_reduce_scatter
from meshfit.dtensor._pipeline import PipelineSpec, PipelineStep, stage_paths
from meshfit.dtensor._stage_gradients import Replicas, StageSync
from meshfit.dtensor._stage_layouts import check_stage_layouts, lay_out_stage, tensor_axis_of
from meshfit.dtensor._stage_unit import StageUnit, tracing_template


class PipelineBuilder:
    """Places a module as pipeline stages along the mesh's pipeline axis (a `PlacementBuilder`)."""

    def __init__(self, spec: PipelineSpec, sharded: bool = False, layout_map: Any = None) -> None:
        self.spec, self.sharded, self.layout_map = spec, sharded, layout_map

    def build(self, module: nn.Module, strategy: Any, jit_compile: bool = False) -> Placement:
        if jit_compile:
            raise ValueError("Invalid `jit_compile=True` under a pipeline: torch.compile of pipeline stages is not "
                             "supported yet. Compile with jit_compile=False (or 'auto').")
        mesh = strategy.mesh
        axis = mesh.dims.axis_of("pipeline")
        if axis is None:
            raise ValueError(f"Invalid pipeline on {mesh!r}: the mesh has no pipeline axis. Add one, e.g. "
                             "create_mesh([('pipe', 2), ...]), or drop layout_map.pipeline(...).")
        data = mesh.dims.axis_of("data")
        tensor = tensor_axis_of(mesh, axis, data)
        keyed = self.layout_map is not None and len(self.layout_map) > 0
        if keyed and tensor is None:
            raise ValueError(f"Invalid LayoutMap keys {list(self.layout_map)[:4]} with a pipeline on {mesh!r}: keys "
                             "split a stage's weights over a tensor axis, and the mesh has none. Add one, e.g. "
                             "create_mesh([('pipe', 2), ('model', 2)]), or remove the keys.")
        if self.sharded and data is None:
            raise ValueError(f"Invalid fully sharded pipeline on {mesh!r}: the stages are sharded over the data axis, "
                             "and the mesh has none. Add one, e.g. create_mesh([('pipe', 2), ('batch', 2)]), or use "
                             "a plain mf.dtensor.LayoutMap(mesh).pipeline(...).")
        size = mesh.dim_size(axis)
        if self.spec.num_stages != size * self.spec.stages_per_rank:
            raise ValueError(f"Invalid `split_points`: {self.spec.num_stages} stages for a {axis!r} axis of {size} "
                             f"with stages_per_rank={self.spec.stages_per_rank}: give {size * self.spec.stages_per_rank - 1} "
                             "split points (one stage per rank, or stages_per_rank per rank).")
        paths = stage_paths(module, self.spec.split_points)
        world = strategy.world
        pipe_rank = world.device_mesh.get_local_rank(axis) if world.distributed else 0
        group = world.group(axis)
        layout = world.device_mesh.mesh if world.distributed else torch.zeros(1, dtype=torch.long)
        along = layout.movedim(mesh.axis_index(axis), 0).reshape(size, -1) if world.distributed else layout.reshape(1, 1)
        stage_ranks = [tuple(sorted(int(r) for r in along[s % size].tolist())) for s in range(self.spec.num_stages)]
        last = frozenset(stage_ranks[-1])  # every replica of the last stage holds its replica's outputs
        residency = StageResidency(world.rank, paths, stage_ranks, last, _log_ranks(world, mesh, axis, tensor, last))
        module = module.to(strategy.device)
        broadcast_initial_values([*module.parameters(), *module.buffers()], strategy)  # replicas start equal
        held = [s for s in range(self.spec.num_stages) if s % size == pipe_rank]
        tensor_mesh = world.sub_mesh(tensor) if tensor is not None and world.distributed else None
        with untracked():  # modules of meshfit's own, over the user's parameters
            template = tracing_template(module)  # before any sharding: the tracer reads shapes, never values
            if tensor is not None and tensor_mesh is not None:  # the stage's weights: DTensors on the tensor axis
                check_stage_layouts(module, self.layout_map, tensor)  # every stage's keys, on every rank
                for s in held:
                    lay_out_stage(module, paths[s], self.layout_map, tensor, tensor_mesh)
            units = [StageUnit(module, paths[s], tensor_mesh) for s in held]
        release_unheld(module, residency.holds)  # other stages' parameters: their shapes alone
        replicas = Replicas(world, data, mesh.dim_size(data)) if data is not None and mesh.dim_size(data) > 1 \
            else None
        weight = GradientWeight() if self.sharded else None
        if weight is not None and data is not None:
            _shard_units(units, module, world.sub_mesh(data), weight, mesh.dim_size(data))
        step = PipelineStep(module, template, units, self.spec, residency, pipe_rank, size, group, strategy.device,
                            world, replicas, weight)
        return place_staged(module, StageSync(), residency, step)  # registers the parameters with the sync


def _log_ranks(world: Any, mesh: Any, pipeline: str, tensor: str | None, last: frozenset[int]) -> frozenset[int]:
    """The last stage's ranks that send metric states in the log reduction: one per data replica (the ranks
    along a tensor axis hold the same outputs: only its coordinate 0 counts)."""
    if tensor is None or not world.distributed:
        return last
    others = [name for name in mesh.axis_names if name != pipeline]
    stage = world.device_mesh.mesh.select(mesh.axis_index(pipeline), mesh.dim_size(pipeline) - 1)
    return frozenset(int(r) for r in stage.select(others.index(tensor), 0).flatten().tolist())


def _shard_units(units: list[StageUnit], module: nn.Module, batch_mesh: Any, weight: GradientWeight,
                 replicas: int) -> None:
    """``fully_shard`` each unit over the data axis (its reduce-scatter weighted by the replicas' rows), and
    give ``module`` the sharded parameters, so the optimizer, checkpoints and ``get_weights`` see them."""
    from torch.distributed.fsdp import fully_shard

    for unit in units:
        if unit.paths:
            fully_shard(unit, mesh=batch_mesh).set_custom_reduce_scatter(_weighted_reduce_scatter(weight, replicas))
            unit.bind_into(module)
