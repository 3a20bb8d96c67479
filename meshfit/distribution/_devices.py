"""The devices and processes of this job, as Keras 3's ``keras.distribution`` counts them (torch backend).

One process drives one device. Under a launcher (``meshfit launch``, torchrun, SLURM, ``TF_CONFIG``)
or once the process group is up, the devices are the job's: one per process, across hosts. In a
plain process they are this host's: its GPUs, else one CPU.
"""

from __future__ import annotations

import torch

from meshfit.cluster import resolve_cluster
from meshfit.distribute import World


def num_processes() -> int:
    """How many processes the job runs (1 for a plain process)."""
    formed = World.process_group_shape()
    if formed is not None:
        return formed[1]
    resolver = resolve_cluster()
    return resolver.world_size if resolver is not None else 1


def process_id() -> int:
    """This process's rank in the job (0 for a plain process)."""
    formed = World.process_group_shape()
    if formed is not None:
        return formed[0]
    resolver = resolve_cluster()
    return (resolver.rank or 0) if resolver is not None else 0


def _default_type() -> str:
    return "gpu" if torch.cuda.is_available() else "cpu"


def _device_type(device_type: str | None) -> str:
    kind = (device_type or _default_type()).lower().split(":")[0]
    kind = "gpu" if kind == "cuda" else kind
    if kind not in ("cpu", "gpu"):
        raise ValueError(f"Invalid `device_type`: expected 'cpu' or 'gpu', received device_type={device_type!r}.")
    return kind


def get_device_count(device_type: str | None = None) -> int:
    """The number of devices of ``device_type`` (default: GPUs if any, else CPUs) for distributed work.

    In a multi-process job: the number of processes (each drives one device) when they are of that
    type, else 0. In a plain process: the local GPUs, or 1 CPU.
    """
    kind = _device_type(device_type)
    if World.process_group_shape() is not None or resolve_cluster() is not None:
        return num_processes() if kind == _default_type() else 0
    return torch.cuda.device_count() if kind == "gpu" else 1


def list_devices(device_type: str | None = None) -> list[str]:
    """The devices for distributed computation, as ``"cpu:0"`` or ``"gpu:1"`` (Keras's names).

    Args:
        device_type: ``"cpu"`` or ``"gpu"`` (default: GPUs if any, else the CPU).

    Returns:
        One entry per device: in a multi-process job the job's devices (one per process), in a
        plain process this host's. Never a mix of types.
    """
    kind = _device_type(device_type)
    return [f"{kind}:{i}" for i in range(get_device_count(kind))]
