"""`MeshStrategy`: training on a named device mesh, with weights laid out by a `LayoutMap`.

The process group is formed exactly as the mirrored strategies form theirs (self-spawned local
processes from a plain script, or the cluster resolver under ``meshfit launch``, torchrun, SLURM
or ``TF_CONFIG``); this strategy then arranges the processes in the mesh's axes.

The axis whose role is data parallel (``"batch"`` by default) is the data-parallel axis: its coordinate
is the data-shard identity (`input_context`), metrics and other sums are reduced over it. How a module
is placed (`meshfit.dtensor._mesh_placement`, built by `meshfit.distribute`'s one plan builder):

- **no layout given** (no map, or an empty one: every weight replicated): plain parameters and DDP's
  bucketed all-reduce over the ``batch`` axis, the `MultiWorkerMirroredStrategy` fast path;
- **tensor-parallel keys** (``nn.Linear``/``nn.Embedding`` weights split over ``model``), in any
  spelling: torch's tensor-parallel styles with plain local activations; then every weight replicated
  over ``batch`` (a plain map), or sharded over it (``LayoutMap.fully_sharded``, Keras's ``ModelParallel``);
- **other layouts** (a kernel, a key over ``batch``, replicated keys): every parameter is a DTensor on
  the whole mesh, as `apply_layouts` makes them; the module's inputs become batch-sharded DTensors and
  its outputs this process's rows again, at the module's boundary (forward hooks), so losses, metrics
  and ``train_step`` overrides see plain tensors. DTensor's autograd sums the gradients of replicated
  weights over ``batch``.
"""

from __future__ import annotations

import contextlib
import copy
import socket
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parameter import is_lazy

from meshfit.distribute import (
    CollectiveStrategy,
    CommunicationOptions,
    GradientWeight,
    InputContext,
    Placement,
    World,
)
from meshfit.dtensor._layout import Layout
from meshfit.dtensor._layout_map import LayoutMap
from meshfit.dtensor._mesh import Mesh
from meshfit.dtensor._mesh_placement import place_on_mesh, plain_tensor_parallel


class PlacementBuilder(Protocol):
    """Builds the `Placement` of a module on a mesh strategy (e.g. a pipeline's stages)."""

    def build(self, module: nn.Module, strategy: MeshStrategy) -> Placement: ...


class MeshStrategy(CollectiveStrategy):
    """The strategy of a mesh made by `create_mesh` (``mesh.strategy``); see the module docstring.

    Args:
        mesh: the mesh value (axis names and sizes).
        world: the `World` the mesh's processes formed (its heartbeat and failure state are shared).
        communication_options: the options the world was formed with.
    """

    def __init__(self, mesh: Mesh, world: World, communication_options: CommunicationOptions | None = None) -> None:
        super().__init__(communication_options, world)
        if self._world != mesh.size:
            raise ValueError(f"Invalid mesh {mesh!r}: it has {mesh.size} devices but {self._world} processes "
                             f"joined. Start {mesh.size} processes (e.g. `meshfit launch --workers {mesh.size}`), "
                             f"or change the axis sizes so that their product is {self._world}.")
        _ensure_group(mesh.device_type)
        if mesh.device_type == "cuda" and self._device.type != "cuda":  # a one-device CUDA mesh
            self._device = torch.device("cuda", torch.cuda.current_device())
        # The World owns the mesh, its sub-meshes and their groups (looked up by axis name).
        self._device_mesh = self.world.form_mesh(mesh.axis_names, mesh.shape, mesh.device_type)
        self.mesh = Mesh(mesh.axis_names, mesh.shape, mesh.device_type, self._device_mesh, self)
        self.layout_map: LayoutMap | None = None
        self._builder: PlacementBuilder | None = None
        self._batch = mesh.dims.data_axis  # the axis whose role is data parallel (None: one replica)
        # at coordinate 0 of every axis but ``batch``: the process that sends its replica's metric states
        self._leads_replica = all(self._device_mesh.get_local_rank(axis) == 0
                                  for axis in mesh.axis_names if axis != self._batch)
        self._gradient_weight = GradientWeight(process_group=self._group_of(self._batch))
        self._grad_factor = 1.0 / self.num_replicas_in_sync
        hosts = self.all_gather_world(socket.gethostname())
        here = hosts[self._rank]
        self.local_device_count = hosts.count(here)
        self.local_device_index = hosts[:self._rank].count(here)

    def with_layout_map(self, layout_map: LayoutMap) -> MeshStrategy:
        """This strategy (same processes) applying ``layout_map`` to the modules it sets up."""
        view = copy.copy(self)
        view.layout_map = layout_map
        return view

    def with_placement_builder(self, builder: PlacementBuilder) -> MeshStrategy:
        """This strategy (same processes) placing the modules it sets up with ``builder`` (a placement
        the layout map cannot spell: its own `Residency` and step runner)."""
        view = copy.copy(self)
        view._builder = builder
        return view

    def places_on_creation(self, module: nn.Module) -> bool:
        """Whether ``mf.Model(module)`` places the module at once (Keras lays variables out when they are
        created): fully sharded, a pipeline, or a plain map's tensor-parallel keys, unless a lazy parameter
        waits for the first batch (a plain map's module made in its scope is then laid out when the scope
        ends). A pipeline placed at creation also evaluates and predicts as a pipeline before any ``fit``."""
        if self.layout_map is None or any(is_lazy(p) for p in module.parameters()):
            return False
        return self.layout_map.is_fully_sharded or self.layout_map.pipeline_spec is not None or \
            plain_tensor_parallel(module, self.layout_map, self._batch) is not None

    # ---- identity: the data-parallel axis --------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        """The size of the ``batch`` axis (1 without one): how many data shards train together."""
        return self.mesh.dim_size(self._batch) if self._batch else 1

    @property
    def replica_id(self) -> int:
        """This process's coordinate along ``batch``."""
        return self._device_mesh.get_local_rank(self._batch) if self._batch else 0

    def input_context(self) -> InputContext:
        return InputContext(num_input_pipelines=self.num_replicas_in_sync, input_pipeline_id=self.replica_id,
                            num_replicas_in_sync=self.num_replicas_in_sync)

    def _group_of(self, axis: str | None) -> Any:
        return self.world.group(axis) if axis is not None and self._world > 1 else None

    # ---- collectives -------------------------------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ``batch``; then every axis agrees (max), so a flag raised anywhere is seen everywhere.

        Processes that differ only along other axes hold the same values, so the max leaves sums
        bitwise unchanged.
        """
        if self._world == 1:
            return tensor
        # The mesh's groups are the device plane (NCCL on a CUDA mesh): the tensor goes to the device.
        moved = tensor.to(self._device) if tensor.device != self._device else tensor
        if self._batch and self.num_replicas_in_sync > 1:
            self.world.all_reduce(moved, axis=self._batch)
        for axis, size in zip(self.mesh.axis_names, self.mesh.shape, strict=True):
            if axis != self._batch and size > 1:
                self.world.all_reduce(moved, op=dist.ReduceOp.MAX, axis=axis)
        if moved is not tensor:
            tensor.copy_(moved)
        return tensor

    def all_reduce_states(self, tensor: torch.Tensor, flags: int = 0, lead: bool | None = None) -> torch.Tensor:
        """Metric states summed over ``batch`` and every process's flags, in one all-reduce over the world.

        ``tensor`` is 1-D: the states, then ``flags`` flags. A replica's processes (those that differ
        only along the other axes) hold the same states, so only its first one (coordinate 0 of every
        other axis) sends them and the others send zeros there (adding a zero is exact); every process
        sends its flags. One collective where `all_reduce_sum` takes one per axis: ``fit`` reads its
        logs this way at every step. See `meshfit.distribute.Strategy.all_reduce_states`. ``lead`` (the
        placement's `Residency`: a pipeline's last stage holds the states) replaces that rule when given.
        """
        if self._world == 1:
            return tensor
        moved = tensor.to(self._device) if tensor.device != self._device else tensor
        leads = self._leads_replica if lead is None else lead
        if not leads and moved.numel() > flags:
            moved[:moved.numel() - flags].zero_()
        self.world.all_reduce(moved)
        if moved is not tensor:
            tensor.copy_(moved)
        return tensor

    def all_gather_world(self, obj: Any) -> list[Any]:
        """Every process's ``obj``, by global rank."""
        return self.world.all_gather_object(obj)  # the control plane

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every data shard's ``obj`` (from the process at coordinate 0 of the other axes), by replica."""
        gathered = self.all_gather_world(obj)
        if self._world == 1:
            return gathered
        ranks = self._device_mesh.mesh
        if self._batch:
            ranks = ranks.movedim(self.mesh.axis_index(self._batch), 0).reshape(self.num_replicas_in_sync, -1)
        else:
            ranks = ranks.reshape(1, -1)
        return [gathered[int(r)] for r in ranks[:, 0].tolist()]

    # ---- placement -------------------------------------------------------------------------
    def setup_module(self, module: nn.Module, jit_compile: bool = False) -> Placement:
        """Place ``module`` by the plan its map asks for (`meshfit.dtensor._mesh_placement`): tensor parallel,
        fully sharded, whole-mesh layouts, DDP over the data axis, or a pipeline; compile if asked."""
        if self._builder is not None:
            return self._builder.build(module, self)
        return place_on_mesh(self, module, jit_compile)

    def _broadcast_from_rank0(self, module: nn.Module) -> None:
        """Rank 0's weights everywhere (DDP broadcasts only within its ``batch`` group)."""
        if self._world == 1 or self.num_replicas_in_sync == self._world:
            return
        self.world.broadcast_tensors([*module.parameters(), *module.buffers()])

    @contextlib.contextmanager
    def batch_weight(self, local_size: int, global_size: int) -> Iterator[None]:
        replicas = self.num_replicas_in_sync
        self._gradient_weight.factor = local_size * replicas / global_size if global_size else 1.0
        self._gradient_weight.in_step = True
        self._grad_factor = local_size / global_size if global_size else 1.0 / replicas
        try:
            yield
        finally:
            self._gradient_weight.end_step()
            self._grad_factor = 1.0 / replicas

    def batch_placements(self) -> list[Any]:
        """DTensor placements of a batch: rows split over ``batch``, replicated along the other axes."""
        return list(Layout.batch_sharded(self.mesh, self._batch, 1).placements) if self._batch \
            else list(Layout.replicated(self.mesh, 1).placements)

    def __repr__(self) -> str:
        return f"MeshStrategy({self.mesh!r}, rank {self._rank} of {self._world}, device={str(self._device)!r})"


def _ensure_group(device_type: str = "cpu") -> None:
    """A one-process group for a one-device mesh (DeviceMesh needs a process group): gloo, with NCCL
    for CUDA tensors on a GPU mesh."""
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
