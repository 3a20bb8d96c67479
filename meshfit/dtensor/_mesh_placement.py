"""Which plan a mesh strategy's map asks for; the plan itself is built by `meshfit.distribute`'s builder.

One tensor-parallel mechanism for every spelling: keys that split ``nn.Linear``/``nn.Embedding`` weights
over one axis other than the data axis take torch's tensor-parallel styles on that axis's sub-mesh
(`TensorParallel`: activations stay plain local tensors, so tensors made inside ``forward`` and
``F.scaled_dot_product_attention`` meet plain local weights). Then the data axis:

- a plain ``mf.dtensor.LayoutMap``: every weight replicated over it, gradients all-reduced
  (`ReplicateOverData`); a keyed weight keeps its `Layout` (``.layout``) and holds its slice;
- ``LayoutMap.fully_sharded`` and Keras's ``ModelParallel`` map (`tensor_parallel_map`): every weight
  sharded over it (`fully_shard_module`).

What that mechanism cannot express keeps the whole-mesh DTensor parameters of `apply_layouts` with the
`Boundary` hooks: a convolution's kernel, a key over the data axis, keys that split nothing, a
column-wise layer whose output slice no layer reads as a slice (`slices_meet_their_readers`), a mesh
without a data axis, ``jit_compile``, and a module whose parameters are DTensors already (laid out by
``layout_map.scope()`` for a custom loop that feeds it ``pack``ed inputs, or by `apply_layouts`). No keys
at all: DDP over the data axis. A pipeline map goes to the pipeline builder.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from meshfit._lazy_dtensor import is_dtensor
from meshfit.distribute import (
    DataParallelSync,
    InPlace,
    MoveTo,
    Placement,
    ProbingDataParallel,
    Transform,
    place_data_parallel,
    place_laid_out,
    place_replicated,
    place_sharded,
    placement_hook,
)
from meshfit.dtensor._apply import apply_layouts, attach_layout, resolve_layouts
from meshfit.dtensor._boundary import Boundary
from meshfit.dtensor._data_axis_sync import DataAxisSync, ReplicateOverData
from meshfit.dtensor._fully_sharded import _check_not_shared as check_not_shared
from meshfit.dtensor._fully_sharded import _default_blocks as default_blocks
from meshfit.dtensor._fully_sharded import fully_shard_module
from meshfit.dtensor._layout_map import LayoutMap
from meshfit.dtensor._pack import batch_dtensors, local_rows_of
from meshfit.dtensor._pipeline_builder import PipelineBuilder
from meshfit.dtensor._scope_layouts import mark_placed
from meshfit.dtensor._tensor_parallel import TensorParallel, slices_meet_their_readers, tensor_parallel_styles


def place_on_mesh(strategy: Any, module: nn.Module, jit_compile: bool) -> Placement:
    """``module`` placed as ``strategy`` (a `MeshStrategy`) and its map say; see the module docstring."""
    layout_map = strategy.layout_map
    if layout_map is not None and layout_map.pipeline_spec is not None:
        builder = PipelineBuilder(layout_map.pipeline_spec, layout_map.is_fully_sharded, layout_map)
        return builder.build(module, strategy, jit_compile)
    layout_map = layout_map if layout_map is not None else LayoutMap(strategy.mesh)
    batch = strategy._batch
    if layout_map.tensor_parallel_first and not jit_compile:
        layout_map = tensor_parallel_map(module, layout_map, batch)
    if layout_map.is_fully_sharded:
        if not any(p.is_meta for p in module.parameters()):  # meta: built block by block
            module.to(strategy.device)
        if jit_compile:
            raise ValueError("Invalid `jit_compile=True` with LayoutMap.fully_sharded: torch.compile of a "
                             "fully sharded model is not supported yet. Compile with jit_compile=False.")
        return fully_shard_module(module, layout_map, strategy.world, batch, strategy._gradient_weight)
    split = None if jit_compile else plain_tensor_parallel(module, layout_map, batch)
    if split is not None:
        return _tensor_parallel_replicated(strategy, module, layout_map, *split)
    layouts = resolve_layouts(module, layout_map)
    # Layouts given (any key, even all replicated: the seed's Dense(kernel_layout=unsharded...)) make
    # DTensor parameters, as apply_layouts per layer does, so pack()ed inputs meet them in custom loops.
    if len(layout_map) or any(not layout.is_fully_replicated() for layout in layouts.values()):
        def lay_out(module: nn.Module) -> None:
            apply_layouts(module, layout_map)
            Boundary(strategy).install(module)

        return place_laid_out(module, strategy.device, jit_compile, [InPlace("whole-mesh layouts", lay_out)])
    attach = InPlace("replicated layouts", lambda m: [attach_layout(m.get_parameter(path), layout)
                                                      for path, layout in layouts.items()])
    broadcast = InPlace("rank 0's weights", strategy._broadcast_from_rank0)
    if strategy.num_replicas_in_sync == 1 or not any(p.requires_grad for p in module.parameters()):
        return place_replicated(module, strategy.device, jit_compile, [attach, broadcast])
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [strategy.device.index] if strategy.device.type == "cuda" else None
    group = strategy._group_of(batch)

    def wrap(module: nn.Module) -> nn.Module:  # searches for unused parameters only if the model has some
        return ProbingDataParallel(module, lambda bucketed, find_unused, static: DistributedDataParallel(
            bucketed, device_ids=device_ids, process_group=group, gradient_as_bucket_view=True,
            static_graph=static, find_unused_parameters=find_unused),
            strategy._on_every_replica, strategy.num_replicas_in_sync)

    sync = DataParallelSync(strategy._gradient_weight, strategy.num_replicas_in_sync)
    return place_data_parallel(module, strategy.device, jit_compile, wrap, sync, [attach, broadcast])


def plain_tensor_parallel(module: nn.Module, layout_map: LayoutMap, batch: str | None) -> tuple[str, dict] | None:
    """(axis, styles) when a plain map's keys all split ``nn.Linear``/``nn.Embedding`` weights over one axis
    of more than one process beside a data axis, and no parameter is laid out already; else None."""
    if batch is None or layout_map.is_fully_sharded or layout_map.pipeline_spec is not None \
            or layout_map.tensor_parallel_first or not len(layout_map):
        return None
    params = list(module.parameters())
    if not params or any(is_dtensor(p) or p.is_meta for p in params) or any(nn.parameter.is_lazy(p) for p in params):
        return None
    try:
        axis, styles = tensor_parallel_styles(module, layout_map, batch)
    except ValueError:  # what the whole-mesh path expresses (a key over the data axis, a kernel, ...)
        return None
    if axis is None or layout_map.mesh.dim_size(axis) < 2 or not slices_meet_their_readers(module, styles):
        return None
    return axis, styles


def _tensor_parallel_replicated(strategy: Any, module: nn.Module, layout_map: LayoutMap, axis: str,
                                styles: dict) -> Placement:
    """Tensor parallel over ``axis``, every weight replicated over the data axis (see `DataAxisSync`)."""
    world = strategy.world
    layouts = resolve_layouts(module, layout_map)

    def attach(module: nn.Module) -> None:  # each weight's `Layout`: a keyed one's, else replicated
        for path, param in module.named_parameters(remove_duplicate=False):
            attach_layout(param, layouts[path])
        _PackedInputs().install(module)
        mark_placed(module)  # the scope it was made in leaves it as it is

    sync = DataAxisSync(strategy._gradient_weight, strategy.num_replicas_in_sync, world, strategy._batch)
    transforms: list[Transform] = [MoveTo(strategy.device), InPlace("rank 0's weights", lambda m: world.broadcast_tensors([*m.parameters(), *m.buffers()])),
                  TensorParallel(axis, styles, world.sub_mesh(axis)), InPlace("layouts", attach),
                  ReplicateOverData(sync)]
    return place_sharded(module, transforms, sync)


class _PackedInputs:
    """A tensor-parallel module's ``pack``ed (DTensor) inputs become this process's rows, and its outputs
    DTensors split over the data axis again, so a custom loop's loss on packed labels meets them."""

    def __init__(self) -> None:
        self.meshes: list[Any] = []  # per call: the inputs' mesh, or None (plain inputs: nothing to undo)

    def install(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(placement_hook(self.before), with_kwargs=True)
        module.register_forward_hook(placement_hook(self.after), with_kwargs=True)

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        local_args, mesh = local_rows_of(args)
        local_kwargs, kwargs_mesh = local_rows_of(kwargs)
        mesh = mesh if mesh is not None else kwargs_mesh
        self.meshes.append(mesh)
        return (local_args, local_kwargs) if mesh is not None else None

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        mesh = self.meshes.pop() if self.meshes else None
        if mesh is None:
            return output
        return batch_dtensors(output, mesh)[0]


def tensor_parallel_map(module: nn.Module, layout_map: LayoutMap, batch: str | None) -> LayoutMap:
    """Keras's ``ModelParallel`` map as the fully sharded map with the same keys, when tensor parallelism
    can split every keyed weight (``nn.Linear``/``nn.Embedding`` over one axis other than ``batch``).

    Then a model runs the same placement as ``mf.dtensor.LayoutMap.fully_sharded`` with those keys (the
    local-output tensor parallelism: tensors made inside ``forward`` meet plain local weights); the
    weights no key matches are sharded over ``batch``, which gives the same values as replicating them.
    Otherwise (a key over ``batch``, a convolution's kernel, keys that split nothing) the map itself,
    whose layouts make whole-mesh DTensor parameters. Keys that match no weight are ignored, as Keras does.
    """
    if batch is None or not len(layout_map):
        return layout_map
    paths = [path for path, _ in module.named_parameters(remove_duplicate=False)]
    unmatched = set(layout_map.unmatched_keys(paths))
    converted = LayoutMap.fully_sharded(layout_map.mesh)
    converted.match = layout_map.match
    for key in layout_map:
        if key not in unmatched:
            converted[key] = layout_map._layout_map[key]
    if not len(converted):
        return layout_map
    try:
        axis, styles = tensor_parallel_styles(module, converted, batch)
    except ValueError:
        return layout_map
    if not slices_meet_their_readers(module, styles):  # a column-wise slice would reach the output
        return layout_map
    try:
        check_not_shared(module, default_blocks(module))
    except ValueError:  # a weight tied across the default blocks (an embedding and its head): one unit
        converted.blocks = []
    return converted if axis is not None else layout_map
