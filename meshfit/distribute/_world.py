"""`World`: one process's place in a job, built once when the group forms and handed to what needs it.

Strategies, `meshfit.train.Checkpoint` and the data view read ranks, devices, groups and timeouts
from a `World` instead of torch's globals (as torchtitan hands its ``ParallelDims`` around), so that
re-forming a job in place is building a new `World` and rebinding to it.

Two planes:

- the **device plane** (``backend``: gloo on CPUs, NCCL on GPUs) carries the model's tensors:
  gradients, parameters, metric states;
- the **control plane** (``control_group``, always gloo) carries flags (stop, preemption), agreement
  between workers, checkpoint bookkeeping and object exchange, as CPU tensors. When the device
  backend is gloo the default group is the control plane (``control_group`` is that group: no
  second group, no second collective).

Every collective names its group: the control group, the whole world's (`group` with no axis) or
a mesh axis's (`group` of ``"batch"``, ``"model"``, ...). Outside this module meshfit calls no
``torch.distributed`` collective without ``group=`` (a test reads the sources), and reads the
default group's rank and size only through `process_group_shape`, before a `World` exists.

The world keeps the `ParallelDims` of its mesh (``dims``): which axis is the data axis is asked of
the axes' roles (`data_group`, `data_axis_of`), never read from an axis's name.
"""

from __future__ import annotations

import contextlib
import dataclasses
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshfit.cluster import ClusterResolver, SingleProcessClusterResolver
from meshfit.distribute._liveness._failure import FailureState
from meshfit.distribute._parallel_dims import ParallelDims, data_axis_of

DEFAULT_TIMEOUT = timedelta(seconds=300)


@dataclasses.dataclass(eq=False)
class World:
    """Ranks, devices, backends, groups and the heartbeat of one process of a job.

    Args:
        rank: this process's global rank.
        size: how many processes the job has.
        device: this process's device (``cuda:<local rank>`` under NCCL, else the CPU).
        backend: the device plane's backend (``"gloo"`` or ``"nccl"``).
        timeout: every collective's and every group creation's timeout (torch's default is 30 min).
        names: who each rank is, for messages (``"worker 1 at 10.0.0.2:2222"``).
        is_chief: whether this process writes the job's files.
        cluster_resolver: TF's identity of this process (``task_type``, ``task_id``).
        failure: what the loop and the savers record for failure messages (step, backup folder).
        heartbeat: the liveness watcher of a group of several processes (None alone or when disabled).
        device_mesh: the named torch ``DeviceMesh`` (None with one process): 1-D ``("batch",)`` when the
            group forms; a mesh strategy re-arranges it in its axes once (`form_mesh`). Its sub-meshes
            (`sub_mesh`) and their groups (`group`) are looked up here by axis name.
        dims: the roles and degrees of ``device_mesh``'s axes (None before a mesh forms): the ``("batch",)``
            mesh's axis is the data axis; `form_mesh` gives a mesh's axes the roles `declare_dims` declared.
        control_group: the gloo group of the control plane (the default group itself when it is
            gloo); None with one process.

    Example:
        >>> world = World.single()
        >>> (world.rank, world.size, world.distributed)
        (0, 1, False)
    """

    rank: int = 0
    size: int = 1
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    backend: str = "gloo"
    timeout: timedelta = DEFAULT_TIMEOUT
    names: tuple[str, ...] = ("rank 0",)
    is_chief: bool = True
    cluster_resolver: ClusterResolver = dataclasses.field(default_factory=SingleProcessClusterResolver)
    failure: FailureState = dataclasses.field(default_factory=FailureState)
    heartbeat: Any = None
    device_mesh: Any = None
    control_group: Any = None
    dims: ParallelDims | None = None
    owns_group: bool = False
    hosts_store: bool = False
    _async_group: Any = dataclasses.field(default=None, repr=False)
    # ``device_mesh[axis]`` builds a new sub-mesh at every call (index tensors, host reads): each is
    # built once per mesh, and `group` reads the group without one.
    _sub_meshes: dict[str, tuple[Any, Any]] = dataclasses.field(default_factory=dict, repr=False)
    # the roles `form_mesh` gives the axes they name (`declare_dims`): the user's, where the mesh is made
    _declared: ParallelDims | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> World:
        """A process training alone (no group)."""
        return cls(device=torch.device(device))

    @classmethod
    def of_process_group(cls, *, device: torch.device | str | None = None, timeout: timedelta | None = None,
                         cluster_resolver: ClusterResolver | None = None, names: tuple[str, ...] | None = None,
                         is_chief: bool | None = None) -> World:
        """The `World` of the default process group someone already initialised (a test, a launcher).

        Builds the ``("batch",)`` device mesh and, when the default backend is not gloo, the gloo
        control group: both collective, so every rank calls this at the same point.
        """
        shape = cls.process_group_shape()
        if shape is None:
            raise ValueError("World.of_process_group: no process group is initialised in this process. Call "
                             "torch.distributed.init_process_group first, or let a strategy form the group.")
        rank, size, backend = shape
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        world = cls(rank=rank, size=size, device=torch.device(device), backend=backend,
                    timeout=timeout or DEFAULT_TIMEOUT, names=names or tuple(f"rank {r}" for r in range(size)),
                    is_chief=rank == 0 if is_chief is None else is_chief,
                    cluster_resolver=cluster_resolver or SingleProcessClusterResolver())
        world.form_planes()
        return world

    @staticmethod
    def process_group_shape() -> tuple[int, int, str] | None:
        """``(rank, size, backend)`` of the default process group someone initialised, else None.

        The one place that reads torch's default group before a `World` exists (joining a group a
        test or a launcher formed, counting a job's devices).
        """
        if not dist.is_available() or not dist.is_initialized():
            return None
        return dist.get_rank(), dist.get_world_size(), str(dist.get_backend())

    @property
    def distributed(self) -> bool:
        """Whether this process has peers (a group of more than one)."""
        return self.size > 1

    def form_planes(self) -> None:
        """Collective, once per group: the named ``batch`` device mesh and the gloo control group."""
        if not self.distributed:
            return
        from torch.distributed.device_mesh import init_device_mesh

        self.device_mesh = init_device_mesh(self.device.type, (self.size,), mesh_dim_names=("batch",))
        self.dims = ParallelDims(names=("batch",), degrees=(self.size,))
        self.control_group = dist.group.WORLD if "gloo" in self.backend else self.new_group(backend="gloo")

    def declare_dims(self, dims: ParallelDims) -> None:
        """The roles of the axes `form_mesh` arranges next (``create_mesh`` declares the user's before its
        strategy forms the mesh); a mesh of these axes formed already takes them at once."""
        self._declared = dims
        current = self.device_mesh
        if current is not None and (tuple(current.mesh_dim_names or ()), tuple(current.mesh.shape)) == \
                (dims.names, dims.degrees):
            self.dims = dims

    def form_mesh(self, axis_names: tuple[str, ...], shape: tuple[int, ...], device_type: str | None = None) -> Any:
        """Collective: arrange this world's processes in named axes; the world owns the mesh from then on.

        The same names and sizes again return the mesh already formed (no new groups). The axes take
        the roles `declare_dims` declared for them, else the roles their names imply (`ParallelDims`).

        Raises:
            ValueError: the axes' sizes do not multiply to this world's size.
        """
        from torch.distributed.device_mesh import init_device_mesh

        declared = self._declared
        if declared is not None and (declared.names, declared.degrees) == (tuple(axis_names), tuple(shape)):
            dims = declared
        else:
            dims = ParallelDims(names=tuple(axis_names), degrees=tuple(shape))
        current = self.device_mesh
        if current is not None and tuple(current.mesh_dim_names or ()) == tuple(axis_names) \
                and tuple(current.mesh.shape) == tuple(shape) and current.device_type == (device_type or current.device_type):
            self.dims = dims
            return current
        dims.validate(self.size)
        self.device_mesh = init_device_mesh(device_type or self.device.type, tuple(shape),
                                            mesh_dim_names=tuple(axis_names))
        self.dims = dims
        return self.device_mesh

    def sub_mesh(self, axis: str) -> Any:
        """The 1-D sub-mesh of ``axis`` this process belongs to (``device_mesh[axis]``)."""
        if self.device_mesh is None or axis not in (self.device_mesh.mesh_dim_names or ()):
            names = [] if self.device_mesh is None else list(self.device_mesh.mesh_dim_names or ())
            raise ValueError(f"Invalid mesh axis {axis!r}: this world's mesh has axes {names}. Form the mesh "
                             "with that axis first (mf.dtensor.create_mesh).")
        if self.device_mesh.ndim == 1:
            return self.device_mesh
        mesh, sub = self._sub_meshes.get(axis, (None, None))
        if mesh is not self.device_mesh:
            mesh, sub = self.device_mesh, self.device_mesh[axis]
            self._sub_meshes[axis] = (mesh, sub)
        return sub

    def group(self, axis: str | None = None) -> Any:
        """The process group of ``axis`` (this process's peers along it), or of the whole world (None)."""
        if axis is None:
            return dist.group.WORLD if self.distributed else None
        return self.sub_mesh(axis).get_group()

    def store(self) -> Any:
        """The key-value store the default group was formed on (the heartbeat and the every-worker calls')."""
        return dist.distributed_c10d._get_default_store()

    # ---- the device plane -----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: Any = None, axis: str | None = None) -> torch.Tensor:
        """All-reduce ``tensor`` in place over the group of ``axis`` (the world's when None), SUM unless
        ``op`` says otherwise. On the device plane: ``tensor`` is on this world's device (NCCL needs it)."""
        if self.distributed:
            dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=self.group(axis))
        return tensor

    def data_group(self) -> Any:
        """The group of the data-parallel replicas: the data axis's (`ParallelDims.data_axis`), the whole
        world's when the mesh has no such axis (None with one process)."""
        return self.group(None if self.device_mesh is None else self.data_axis_of(self.device_mesh))

    def data_axis_of(self, device_mesh: Any) -> str | None:
        """The data axis among a torch ``DeviceMesh``'s axes (this world's mesh or one of its sub-meshes),
        by this world's roles; a mesh of other axes by the roles their names imply. None: it has none."""
        return data_axis_of(device_mesh, self.dims)

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int = 0, axis: str | None = None) -> None:
        """Rank ``src`` (of the group of ``axis``, of the world when None) sends ``tensors``' values, in place.

        On the device plane: the tensors are the model's (parameters, buffers).
        """
        if not self.distributed:
            return
        group = self.group(axis)
        if dist.get_world_size(group) == 1:
            return
        source = dist.get_global_rank(group, src)
        with torch.no_grad():
            for tensor in tensors:
                dist.broadcast(tensor.data, src=source, group=group)

    def new_group(self, ranks: list[int] | None = None, backend: str | None = None) -> Any:
        """``torch.distributed.new_group`` with this world's timeout (collective: every rank calls it)."""
        return dist.new_group(ranks, timeout=self.timeout, backend=backend)

    def async_group(self) -> Any:
        """A gloo group of its own for background saves, created on first use (on every rank at once).

        An async save runs collectives from a writer thread while training issues its own; one group
        shared by two threads would interleave them differently per rank.
        """
        if self._async_group is None:
            self._async_group = self.new_group(backend="gloo")
        return self._async_group

    # ---- the control plane ----------------------------------------------------------------------
    def control(self) -> Any:
        """The control plane's group (None with one process)."""
        if not self.distributed:
            return None
        if self.control_group is None:
            raise RuntimeError(f"This World ({self.size} processes) has no control group yet: form its planes first "
                               "(World.form_planes, collective).")
        return self.control_group

    def control_all_reduce(self, tensor: torch.Tensor, op: Any = None) -> torch.Tensor:
        """All-reduce a CPU tensor over the control plane, in place (SUM unless ``op`` says otherwise)."""
        if self.distributed:
            dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=self.control())
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank, over the control plane."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.control())
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank, over the control plane."""
        if not self.distributed:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=src, group=self.control())
        return holder[0]

    def barrier(self) -> None:
        """Every rank reaches this point (over the control plane)."""
        if self.distributed:
            dist.barrier(group=self.control())

    # ---- lifetime -------------------------------------------------------------------------------
    def shutdown(self, wait_for_peers: float = 0.0) -> None:
        """Stop the heartbeat, destroy the group this world formed."""
        if self.heartbeat is not None:
            self.heartbeat.stop(wait_for_peers=wait_for_peers if self.hosts_store else 0.0)
            self.heartbeat = None
        if self.owns_group and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            self.owns_group = False

