"""`CollectiveStrategy`: replicas in several processes on a 1-D ``batch`` device mesh.

Shared by `MultiWorkerMirroredStrategy` and `MirroredStrategy`: one process per replica, a
torch.distributed process group (gloo for RING, NCCL for GPUs), gradients all-reduced by
``DistributedDataParallel``, and a heartbeat watchdog so that a dead peer never hangs the others.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from meshfit._runtime import freeze_heap_at_exit
from meshfit.cluster import (
    ClusterResolver,
    SimpleClusterResolver,
    SingleProcessClusterResolver,
    parse_address,
    resolve_cluster,
)
from meshfit.distribute._gradient_sync import DataParallelSync
from meshfit.distribute._gradient_weight import GradientWeight, bfloat16_allreduce_hook
from meshfit.distribute._liveness._heartbeat import Heartbeat, PeerFailureError, report_uncaught_peer_failures
from meshfit.distribute._liveness._liveness import (
    LIVENESS_INVITATION,
    invitation,
    join_liveness,
    open_liveness,
    read_invitation,
)
from meshfit.distribute._liveness._rendezvous import client_for, form_rendezvous, store_host_rank
from meshfit.distribute._liveness._startup import quiet_c10d_retries, share_cores
from meshfit.distribute._placement import Placement
from meshfit.distribute._plan_builder import place_data_parallel, place_replicated
from meshfit.distribute._proof._model_agreement import agree_on_tensors, module_entries
from meshfit.distribute._scope import clear_process_world, process_world, set_process_world
from meshfit.distribute._strategy import Strategy
from meshfit.distribute._unused_parameters import ProbingDataParallel
from meshfit.distribute._values import CommunicationImplementation, CommunicationOptions
from meshfit.distribute._world import World

# gloo's C++ errors reach Python as plain RuntimeError (DDP's hooks wrap them in another); their text
# carries the gloo source location that raised them: ``[.../gloo/transport/tcp/pair.cc:553] ...``.
_GLOO_ORIGIN = re.compile(r"\[[^\]\s]*/gloo/[^\]\s]*\.(?:cc|cpp|h):\d+\]")


def is_communication_error(error: BaseException) -> bool:
    """A broken collective or store (worth asking the heartbeat which peer died), not a user error.

    Decided by type (torch's ``DistError`` family: backend, store and network errors) or by origin
    (raised inside gloo), never by words such as "timeout" that a user's message may contain.
    """
    return isinstance(error, dist.DistError) or bool(_GLOO_ORIGIN.search(str(error)))


def choose_backend(options: CommunicationOptions) -> str:
    """The torch.distributed backend for ``options``; NCCL without GPUs is an error."""
    implementation = options.implementation
    if implementation is CommunicationImplementation.NCCL:
        if not torch.cuda.is_available():
            raise ValueError("CommunicationImplementation.NCCL needs GPUs, and none is available here. "
                             "Use CommunicationImplementation.RING (gloo) or AUTO.")
        return "nccl"
    if implementation is CommunicationImplementation.RING:
        return "gloo"
    return "nccl" if torch.cuda.is_available() else "gloo"


def join_world(options: CommunicationOptions, rank: int, world_size: int, master: tuple[str, int] | None, *,
               local_rank: int = 0, names: list[str] | None = None, own_host: str | None = None,
               settings: dict[str, Any] | None = None, cluster_resolver: Any = None) -> World:
    """Form (or join) the process group and return this process's `World`.

    ``master`` is rank 0's rendezvous ``(host, port)``. A group someone already initialised is joined
    as it is. With several processes: the planes (device mesh, control group), the heartbeat, and a
    shutdown at exit.
    """
    backend = choose_backend(options)
    timeout = timedelta(seconds=float(options.timeout_seconds))
    hosting, owns = False, False
    formed = World.process_group_shape()
    if formed is not None:
        rank, world_size, backend = formed
    elif world_size > 1:
        if master is None:
            raise ValueError("Invalid cluster: several workers but no rendezvous address for rank 0.")
        names = names or [f"rank {r}" for r in range(world_size)]
        agreed = {"backend": backend, "timeout_seconds": float(options.timeout_seconds),
                  "heartbeat_timeout_seconds": options.heartbeat_timeout_seconds, **(settings or {})}
        with quiet_c10d_retries():  # meshfit says whom it waits for; torch's retry log would drown it
            store, hosting, names = form_rendezvous(rank, world_size, master, own_host, backend, timeout, names,
                                                    agreed)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        owns = True
    device = torch.device("cpu")
    if "nccl" in backend:
        device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    world = World(rank=rank, size=world_size, device=device, backend=backend, timeout=timeout,
                  names=tuple(names or [f"rank {r}" for r in range(world_size)]), is_chief=rank == 0,
                  cluster_resolver=cluster_resolver or SingleProcessClusterResolver(), owns_group=owns)
    if world.distributed:
        world.form_planes()
        if owns:
            share_cores(world.all_gather_object, rank)
        set_process_world(world)
        report_uncaught_peer_failures()
        _start_heartbeat(world, options, hosting)

        def shutdown() -> None:
            world.shutdown(wait_for_peers=float(options.timeout_seconds))
            clear_process_world(world)
            freeze_heap_at_exit()  # after the world's own shutdown: Python's then skips torch's objects

        atexit.register(shutdown)
    return world


def _start_heartbeat(world: World, options: CommunicationOptions, hosting: bool) -> None:
    seconds = options.heartbeat_timeout_seconds
    if seconds is None:
        return
    default_store = world.store()
    liveness = None
    message = torch.zeros(LIVENESS_INVITATION, dtype=torch.uint8, device=world.device)
    if world.rank == 0:
        secret = os.urandom(16)
        liveness, address = open_liveness(world.size, secret, default_store)
        message.copy_(torch.frombuffer(bytearray(invitation(secret, address)), dtype=torch.uint8))
    world.broadcast_tensors([message])  # over the group, never through the store anyone may read
    secret, address = read_invitation(bytes(message.cpu().tolist()))
    probe = timedelta(seconds=max(1.0, seconds / 2))
    store_host = store_host_rank(default_store, hosting)
    world.hosts_store = store_host == world.rank
    world.heartbeat = Heartbeat(lambda: client_for(default_store, probe), world.rank, world.size, seconds,
                                world.failure, secret, list(world.names), store_host)
    if world.rank != 0 and address is not None:
        liveness = join_liveness(world.rank, world.size, secret, address, seconds)
    if liveness is not None:  # a killed peer's connection closes: named at once, not after `seconds`
        liveness.on_death = world.heartbeat.peer_ended
        world.heartbeat.liveness = liveness


class CollectiveStrategy(Strategy):
    """Base of the multi-process strategies: a strategy bound to a `World` of one or more processes.

    Args:
        communication_options: backend, timeouts, DDP's bucket size, gradient compression.
        world: the `World` to run in (default: this process alone). Subclasses form one from the
            environment (`join_world`); a test or a launcher may hand one in.
    """

    def __init__(self, communication_options: CommunicationOptions | None = None,
                 world: World | None = None) -> None:
        if communication_options is None:
            communication_options = CommunicationOptions()
        if not isinstance(communication_options, CommunicationOptions):
            raise TypeError("Invalid `communication_options`: expected meshfit.CommunicationOptions, "
                            f"received {communication_options!r}.")
        self.communication_options = communication_options
        self.world = world if world is not None else World.single()
        self._gradient_weight = GradientWeight(compression=communication_options.gradient_compression,
                                               process_group=self.world.group())
        self.mesh: Any = self.world.device_mesh
        if self.world.distributed and process_world() is None:
            set_process_world(self.world)

    # ---- the world this strategy runs in (one value: see `World`) ---------------------------
    @property
    def _rank(self) -> int:
        return self.world.rank

    @property
    def _world(self) -> int:
        return self.world.size

    @property
    def _chief(self) -> bool:
        return self.world.is_chief

    @property
    def _heartbeat(self) -> Heartbeat | None:
        return self.world.heartbeat

    # ---- identity ------------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        return self._world

    @property
    def replica_id(self) -> int:
        return self._rank

    @property
    def num_processes(self) -> int:
        return self._world

    @property
    def is_chief(self) -> bool:
        return self._chief

    @property
    def _distributed(self) -> bool:
        return self._world > 1

    # ---- collectives: each watched, a broken one turned into an error naming the failed peer --------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._distributed:
            return tensor
        with self.guard():
            if self._device.type != "cpu":
                moved = tensor.to(self._device)
                self.world.all_reduce(moved)
                tensor.copy_(moved.to(tensor.device))
            else:
                self.world.all_reduce(tensor)
        return tensor

    def all_reduce_control(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._distributed:
            return tensor
        if tensor.device.type != "cpu":
            raise ValueError(f"Invalid `tensor`: the control plane (gloo) carries CPU tensors, received one on "
                             f"{tensor.device}. Send device tensors with all_reduce_sum.")
        with self.guard():
            self.world.control_all_reduce(tensor)
        return tensor

    # objects and barriers travel on the control plane (gloo), never through the device backend
    def broadcast_object(self, obj: Any) -> Any:
        if not self._distributed:
            return obj
        with self.guard():
            return self.world.broadcast_object(obj)

    def broadcast_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._distributed:
            return tensor
        with self.guard():
            if self._device.type != "cpu":
                moved = tensor.to(self._device)
                self.world.broadcast_tensors([moved])
                tensor.copy_(moved.to(tensor.device))
            else:
                self.world.broadcast_tensors([tensor])
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self._distributed:
            return [obj]
        with self.guard():
            return self.world.all_gather_object(obj)

    def barrier(self) -> None:
        if self._distributed:
            with self.guard():
                self.world.barrier()

    # ---- placement ---------------------------------------------------------------------------
    def setup_module(self, module: torch.nn.Module, jit_compile: bool = False) -> Placement:
        """Move ``module`` to this replica's device, compile it if asked, wrap it in DDP with a
        batch-weighting hook (`DataParallelSync`)."""
        if self._distributed:  # other shapes on another worker would abort gloo in DDP's first broadcast
            agree_on_tensors(self.all_gather_object, module_entries(module), "models",
                             "Build the same model on every worker.")
        if not self._distributed or not any(p.requires_grad for p in module.parameters()):
            return place_replicated(module, self._device, jit_compile)
        device_ids = [self._device.index] if self._device.type == "cuda" else None
        options = self.communication_options
        pack: dict[str, Any] = {"bucket_cap_mb": options.bytes_per_pack / 2**20} if options.bytes_per_pack else {}
        weight, world = self._gradient_weight, self.world

        def build(bucketed: torch.nn.Module, find_unused: bool, static_graph: bool) -> DistributedDataParallel:
            ddp = DistributedDataParallel(bucketed, device_ids=device_ids, process_group=world.group(),
                                          gradient_as_bucket_view=True,
                                          find_unused_parameters=find_unused, static_graph=static_graph, **pack)
            if weight.compression == "bfloat16":
                ddp.register_comm_hook(weight, bfloat16_allreduce_hook)
            return ddp

        def wrap(module: torch.nn.Module) -> torch.nn.Module:  # the search only if the model needs it
            return ProbingDataParallel(module, build, self._on_every_replica, self._world)

        return place_data_parallel(module, self._device, jit_compile, wrap,
                                   DataParallelSync(self._gradient_weight, self._world))

    def _on_every_replica(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every process (summed on the control plane)."""
        return int(self.all_reduce_control(torch.tensor([int(flag)])).item()) == self._world

    def batch_weight(self, local_size: int, global_size: int) -> contextlib.AbstractContextManager[None]:
        return DataParallelSync.weighting_of(self._gradient_weight, self._world, local_size, global_size)

    def check_alive(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.check()

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Watch peers while inside; turn a broken collective into an error naming the failed peer.

        Regions nest (``fit`` guards its loop, and each collective guards itself). A failure the
        watchdog found earlier is raised on entry; one it finds while the main thread is blocked in
        a collective here ends the process with the message (`PEER_FAILURE_EXIT_CODE`).
        """
        heartbeat = self._heartbeat
        if heartbeat is None:
            yield
            return
        heartbeat.check()
        with heartbeat.watching():
            try:
                yield
            except Exception as error:
                if (isinstance(error, PeerFailureError) or self.failure.terminating
                        or not is_communication_error(error)):
                    raise
                seconds = float(self.communication_options.heartbeat_timeout_seconds or 0) + 2
                failure = heartbeat.wait_for_failure(seconds)
                if failure is not None:
                    raise failure from error
                raise

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(replica {self._rank} of {self._world}, device={str(self._device)!r}, "
                f"pid={os.getpid()})")


def local_resolver(rank: int, world_size: int, master: tuple[str, int] | None,
                   local_rank: int | None = None) -> ClusterResolver:
    """``cluster_resolver`` for processes that no launcher described: alone, TF's single worker
    (`SingleProcessClusterResolver`, ``task_type`` None); several (local replicas, a group the user
    formed), each a ``"worker"`` whose ``task_id`` is its rank, so only rank 0 counts as the chief.
    Both are ``synthetic``: ``RunConfig`` reads the environment, as TF's does, not them."""
    if world_size == 1:
        return SingleProcessClusterResolver()
    host, port = master if master is not None else ("127.0.0.1", 29500)
    resolver = SimpleClusterResolver(rank, world_size, master_addr=host, master_port=port,
                                     local_rank=rank if local_rank is None else local_rank)
    resolver.synthetic = True
    return resolver


def group_resolver(local_rank: int) -> ClusterResolver:
    """A resolver for a process group the user initialised: the environment's, when it describes this
    group (torchrun's variables, ``TF_CONFIG``), else `local_resolver`'s (rank 0's address from
    ``MASTER_ADDR``/``MASTER_PORT`` when set)."""
    formed = World.process_group_shape()
    if formed is None:
        raise ValueError("group_resolver: no process group is initialised in this process.")
    rank, world = formed[0], formed[1]
    try:
        found = resolve_cluster()
    except ValueError:  # the group exists already; a stale or partial environment does not matter
        found = None
    if found is not None and found.rank == rank and found.world_size == world:
        return found
    try:
        master = parse_address(f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}",
                               "MASTER_ADDR:MASTER_PORT", "environment")
    except ValueError:
        master = None
    return local_resolver(rank, world, master, local_rank)
