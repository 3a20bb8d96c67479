"""`MirroredStrategy`: one replica per local device, one process per replica.

PyTorch runs one process per device. From a plain ``python train.py``, the strategy built in the
first process (replica 0) starts the other replicas itself through the process supervisor
(`meshfit._runtime._supervisor.spawn_local_replicas`), which runs the same script again; they build the same
strategy, join the group and follow the same code. Replica 0 waits for them at exit and fails if one
of them failed.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from meshfit._runtime import LocalReplicas, free_ports, replica_identity, spawn_local_replicas, watch_parent
from meshfit.distribute._collective import CollectiveStrategy, group_resolver, join_world, local_resolver
from meshfit.distribute._liveness._exit_deadline import EXIT_SECONDS, extend_deadline
from meshfit.distribute._strategy import _parse_device
from meshfit.distribute._values import CommunicationImplementation, CommunicationOptions
from meshfit.distribute._world import World

_AFTER_FAILURE_S = 2 * EXIT_SECONDS  # how long replica 0 waits for its replicas after a peer failure


class MirroredStrategy(CollectiveStrategy):
    """Synchronous training on several devices of this machine.

    Args:
        devices: e.g. ``["cuda:0", "cuda:1"]`` or ``["cpu:0", "cpu:1"]`` (two CPU replicas in two
            processes). Default: every local GPU, else the CPU alone.
        communication_options: backend and timeouts (default: NCCL for GPUs, gloo for CPUs).

    Example:
        >>> MirroredStrategy(devices=["cpu:0"]).num_replicas_in_sync
        1
    """

    def __init__(self, devices: Sequence[str] | None = None,
                 communication_options: CommunicationOptions | None = None) -> None:
        parsed, options = local_devices(devices, communication_options)
        super().__init__(options, form_local_world(parsed, options))
        self.devices = parsed

    @staticmethod
    def _resolve_devices(devices: Sequence[str] | None) -> list[torch.device]:
        if devices is None:
            count = torch.cuda.device_count()
            return [torch.device("cuda", i) for i in range(count)] if count else [torch.device("cpu")]
        if isinstance(devices, str) or not devices:
            raise ValueError("Invalid `devices`: expected a non-empty list such as ['cpu:0', 'cpu:1'] or "
                             f"['cuda:0', 'cuda:1'], received devices={devices!r}.")
        parsed = [_parse_device(d.replace("/gpu:", "cuda:").replace("gpu:", "cuda:")
                                if isinstance(d, str) else d) for d in devices]
        kinds = {d.type for d in parsed}
        if len(kinds) > 1:
            raise ValueError(f"Invalid `devices`: mix of CPU and GPU devices {list(devices)!r}; use one kind.")
        if len({str(d) for d in parsed}) != len(parsed) and kinds == {"cuda"}:
            raise ValueError(f"Invalid `devices`: a GPU is listed twice in {list(devices)!r}.")
        return parsed


def local_devices(devices: Sequence[str] | None, options: CommunicationOptions | None,
                  ) -> tuple[list[torch.device], CommunicationOptions]:
    """``devices`` parsed (default: every local GPU, else the CPU alone) and the options for them
    (default: NCCL for GPUs, gloo for CPUs)."""
    parsed = MirroredStrategy._resolve_devices(devices)
    if options is None:
        on_gpu = parsed[0].type == "cuda"
        options = CommunicationOptions(implementation=CommunicationImplementation.NCCL if on_gpu
                                       else CommunicationImplementation.RING)
    return parsed, options


def form_local_world(devices: list[torch.device], options: CommunicationOptions) -> World:
    """The `World` of one process per local device: started here from a plain script (replica 0
    spawns the others, which run the same script), or the group someone already initialised."""
    count = len(devices)
    if count == 1 or dist.is_initialized():
        world = join_world(options, 0, 1, None)
        world.device = devices[world.rank % count]
        world.cluster_resolver = (group_resolver(int(os.environ.get("LOCAL_RANK", world.rank)))
                                  if dist.is_initialized() else local_resolver(0, 1, None))
        return world
    identity = replica_identity()
    if identity is None:
        rank, address = 0, f"127.0.0.1:{free_ports(1)[0]}"
        replicas = spawn_local_replicas(count, address)
        atexit.register(_wait_for_replicas, replicas, float(options.timeout_seconds))
    else:
        rank, address = identity
        watch_parent()
    host, _, port = address.rpartition(":")
    world = join_world(options, rank, count, (host, int(port)), local_rank=rank,
                       names=[f"replica {r} ({devices[r]})" for r in range(count)],
                       cluster_resolver=local_resolver(rank, count, (host, int(port))))
    world.device = devices[rank]
    if world.device.type == "cuda":
        torch.cuda.set_device(world.device)
    return world


def _wait_for_replicas(replicas: LocalReplicas, timeout: float) -> None:
    if extend_deadline(_AFTER_FAILURE_S + 15):  # ending after a peer failure: each replica ends within
        timeout = min(timeout, _AFTER_FAILURE_S)  # EXIT_SECONDS of its own exit; stay up to report them
    failed = replicas.wait(timeout)
    if failed:
        print("meshfit: MirroredStrategy: " + "; ".join(failed), file=sys.stderr, flush=True)
        os._exit(1)
