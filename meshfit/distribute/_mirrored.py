"""`MirroredStrategy`: one replica per local device, one process per replica.

PyTorch runs one process per device. From a plain ``python train.py``, the strategy built in the
first process (replica 0) starts the other replicas itself by running the same script again with
``MESHFIT_MIRRORED_RANK`` set; they build the same strategy, join the group and follow the same
code. Replica 0 waits for them at exit and fails if one of them failed.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from meshfit._launch import free_ports
from meshfit.distribute._collective import CollectiveStrategy
from meshfit.distribute._strategy import _parse_device
from meshfit.distribute._values import CommunicationImplementation, CommunicationOptions

_RANK_ENV = "MESHFIT_MIRRORED_RANK"
_ADDR_ENV = "MESHFIT_MIRRORED_ADDR"
_PARENT_ENV = "MESHFIT_MIRRORED_PARENT"


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
        devices = self._resolve_devices(devices)
        on_gpu = devices[0].type == "cuda"
        if communication_options is None:
            impl = CommunicationImplementation.NCCL if on_gpu else CommunicationImplementation.RING
            communication_options = CommunicationOptions(implementation=impl)
        super().__init__(communication_options)
        self.devices = devices
        self._children: list[subprocess.Popen] = []
        world = len(devices)
        if world == 1 or dist.is_initialized():
            self._join(0, 1, None)
            self._device = devices[self._rank % world]
            self._chief = self._rank == 0
            return
        rank = int(os.environ.get(_RANK_ENV, "0"))
        if rank == 0:
            address = f"127.0.0.1:{free_ports(1)[0]}"
            self._spawn_replicas(world, address)
        else:
            address = os.environ[_ADDR_ENV]
            _watch_parent(int(os.environ[_PARENT_ENV]))
        self._join(rank, world, f"tcp://{address}", local_rank=rank)
        self._device = devices[rank]
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        self._chief = rank == 0

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

    def _spawn_replicas(self, world: int, address: str) -> None:
        script = sys.argv[0] if sys.argv else ""
        if not script or script == "-c" or not os.path.exists(script):
            raise RuntimeError(
                "MirroredStrategy with several devices starts one process per device by running your "
                f"script again, but this process has no script to run (sys.argv[0]={script!r}). Run it as "
                "`python train.py`, or start the replicas with `meshfit launch` / torchrun and use "
                "MultiWorkerMirroredStrategy.")
        for rank in range(1, world):
            env = dict(os.environ, **{_RANK_ENV: str(rank), _ADDR_ENV: address, _PARENT_ENV: str(os.getpid())})
            env.setdefault("OMP_NUM_THREADS", "1")
            self._children.append(subprocess.Popen([sys.executable, *sys.argv], env=env))
        atexit.register(self._wait_for_replicas)

    def _wait_for_replicas(self) -> None:
        deadline = time.monotonic() + float(self.communication_options.timeout_seconds)
        failed = []
        for rank, child in enumerate(self._children, start=1):
            try:
                code = child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                code = child.wait()
            if code != 0:
                failed.append(f"replica {rank} (pid {child.pid}) exited with code {code}")
        if failed:
            print("meshfit: MirroredStrategy: " + "; ".join(failed), file=sys.stderr, flush=True)
            os._exit(1)


def _watch_parent(parent: int) -> None:
    """A spawned replica ends itself if replica 0 goes away, instead of waiting on it forever."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="meshfit-parent-watch").start()
