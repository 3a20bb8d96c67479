"""`CollectiveStrategy`: replicas in several processes on a 1-D ``batch`` device mesh.

Shared by `MultiWorkerMirroredStrategy` and `MirroredStrategy`: one process per replica, a
torch.distributed process group (gloo for RING, NCCL for GPUs), gradients all-reduced by
``DistributedDataParallel``, and a heartbeat watchdog so that a dead peer never hangs the others.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from meshfit.distribute._failure import FailureState
from meshfit.distribute._gradient_weight import GradientWeight, weighted_allreduce_hook
from meshfit.distribute._heartbeat import Heartbeat
from meshfit.distribute._scope import register_running
from meshfit.distribute._strategy import Strategy, compiled
from meshfit.distribute._values import CommunicationImplementation, CommunicationOptions

_COMMUNICATION_HINTS = ("gloo", "nccl", "connection", "closed by peer", "timed out", "timeout",
                        "socket", "store", "broken pipe")


def _is_communication_error(error: BaseException) -> bool:
    """A failed collective (worth asking the heartbeat which peer died), not a user error."""
    if isinstance(error, dist.DistBackendError):
        return True
    text = str(error).lower()
    return any(hint in text for hint in _COMMUNICATION_HINTS)


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


class CollectiveStrategy(Strategy):
    """Base of the multi-process strategies; subclasses decide how the group is formed."""

    def __init__(self, communication_options: CommunicationOptions | None = None) -> None:
        if communication_options is None:
            communication_options = CommunicationOptions()
        if not isinstance(communication_options, CommunicationOptions):
            raise TypeError("Invalid `communication_options`: expected meshfit.CommunicationOptions, "
                            f"received {communication_options!r}.")
        self.communication_options = communication_options
        self._rank, self._world, self._chief = 0, 1, True
        self._owns_group = False
        self._heartbeat: Heartbeat | None = None
        self.failure = FailureState()
        self._gradient_weight = GradientWeight()
        self.mesh: Any = None
        self._device = torch.device("cpu")
        self.cluster_resolver: Any = None

    # ---- forming the group ----------------------------------------------------------------
    def _join(self, rank: int, world_size: int, init_method: str | None, local_rank: int = 0) -> None:
        backend = choose_backend(self.communication_options)
        timeout = timedelta(seconds=float(self.communication_options.timeout_seconds))
        if dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
            backend = dist.get_backend()
        elif world_size > 1:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                    timeout=timeout)
            self._owns_group = True
            atexit.register(self._shutdown)
        self._rank, self._world = rank, world_size
        if backend == "nccl":
            self._device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
            torch.cuda.set_device(self._device)
        if world_size > 1:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(self._device.type, (world_size,), mesh_dim_names=("batch",))
            register_running(self)
            hb = self.communication_options.heartbeat_timeout_seconds
            store = dist.distributed_c10d._get_default_store()
            if hb is not None:
                self._heartbeat = Heartbeat(store, rank, world_size, hb, self.failure)

    def _shutdown(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._owns_group and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            self._owns_group = False

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

    # ---- collectives ---------------------------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._distributed:
            return tensor
        if self._device.type != "cpu":
            moved = tensor.to(self._device)
            dist.all_reduce(moved)
            tensor.copy_(moved.to(tensor.device))
        else:
            dist.all_reduce(tensor)
        return tensor

    def broadcast_object(self, obj: Any) -> Any:
        if not self._distributed:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def broadcast_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._distributed:
            return tensor
        if self._device.type != "cpu":
            moved = tensor.to(self._device)
            dist.broadcast(moved, src=0)
            tensor.copy_(moved.to(tensor.device))
        else:
            dist.broadcast(tensor, src=0)
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self._distributed:
            return [obj]
        out: list[Any] = [None] * self._world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self._distributed:
            dist.barrier()

    # ---- placement ---------------------------------------------------------------------------
    def setup_module(self, module: torch.nn.Module, jit_compile: bool = False) -> torch.nn.Module:
        """Move ``module`` to this replica's device, compile it if asked, wrap it in DDP with a
        batch-weighting hook."""
        module = compiled(module.to(self._device), jit_compile)
        if not self._distributed or not any(p.requires_grad for p in module.parameters()):
            return module
        from meshfit.distribute._replication import mark_ddp_synchronized

        device_ids = [self._device.index] if self._device.type == "cuda" else None
        wrapped = DistributedDataParallel(module, device_ids=device_ids, gradient_as_bucket_view=True)
        wrapped.register_comm_hook(self._gradient_weight, weighted_allreduce_hook)
        mark_ddp_synchronized(wrapped)  # the optimizer must not reduce these gradients again
        return wrapped

    @contextlib.contextmanager
    def batch_weight(self, local_size: int, global_size: int) -> Iterator[None]:
        factor = local_size * self._world / global_size if global_size else 1.0
        self._gradient_weight.factor = factor
        try:
            yield
        finally:
            self._gradient_weight.factor = 1.0

    def check_alive(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.check()

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Watch peers while inside; turn a broken collective into an error naming the dead peer."""
        if self._heartbeat is None:
            yield
            return
        with self._heartbeat.watching():
            try:
                yield
            except (RuntimeError, dist.DistBackendError) as error:
                from meshfit.distribute._heartbeat import PeerFailureError

                if (isinstance(error, PeerFailureError) or self.failure.terminating
                        or not _is_communication_error(error)):
                    raise
                failure = self._heartbeat.wait_for_failure(self.communication_options.heartbeat_timeout_seconds + 2)
                if failure is not None:
                    raise failure from error
                raise

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(replica {self._rank} of {self._world}, device={str(self._device)!r}, "
                f"pid={os.getpid()})")
