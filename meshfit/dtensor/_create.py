"""`create_mesh`: form the process group (as the mirrored strategies do) and arrange it in named axes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from meshfit._runtime import replica_identity
from meshfit.cluster import resolve_cluster
from meshfit.distribute import (
    CommunicationOptions,
    World,
    form_cluster_world,
    form_local_world,
    local_devices,
)
from meshfit.dtensor._mesh import Mesh


def create_mesh(mesh_dims: Sequence[tuple[str, int]], devices: Sequence[str] | None = None,
                communication_options: CommunicationOptions | None = None, *,
                roles: Mapping[str, str] | None = None) -> Mesh:
    """A mesh of ``prod(sizes)`` processes with named axes, as ``dtensor.create_mesh``.

    From a plain ``python train.py`` with local ``devices`` (``["cpu:0", ..., "cpu:3"]``), the
    first process starts the others itself, as `MirroredStrategy` does. Under ``meshfit launch``,
    torchrun, SLURM or ``TF_CONFIG``, the processes are the job's workers (the cluster resolver's
    group, as for `MultiWorkerMirroredStrategy`), and ``devices`` only checks the count.

    Args:
        mesh_dims: ``[(axis_name, size), ...]``, e.g. ``[("batch", 2), ("model", 2)]``.
        devices: the mesh's devices, one per process, e.g. ``[f"cpu:{i}" for i in range(4)]``
            (default: one per process of the job).
        communication_options: backend and timeouts (default: gloo on CPUs, NCCL on GPUs).
        roles: what the axes do, ``{axis: role}`` (`ParallelDims`), e.g. ``{"dp": "data"}`` for a data
            axis named ``"dp"``; an axis not given takes the role its name implies: ``"batch"`` is the
            data-parallel axis, ``"pipe"`` the pipeline axis, any other name a tensor axis.

    Returns:
        The `Mesh`, with its torch ``DeviceMesh`` and its strategy (``mesh.strategy``).

    Raises:
        ValueError: a malformed ``mesh_dims``, a repeated or unknown axis name, a bad role (see
            `ParallelDims`), or a number of devices or processes different from the mesh size (the
            message says how to fix it).

    Example:
        >>> mesh = create_mesh([("dp", 2), ("tp", 2)], devices=[f"cpu:{i}" for i in range(4)],  # doctest: +SKIP
        ...                    roles={"dp": "data"})
        >>> mesh.dims, mesh.strategy.num_replicas_in_sync  # doctest: +SKIP
        (ParallelDims(dp=2:data, tp=2:tensor), 2)
    """
    value = _mesh_value(mesh_dims, devices, roles)
    world, options = _form_world(value, devices, communication_options)
    world.declare_dims(value.dims)  # the roles the strategy's mesh of these axes gets
    from meshfit.dtensor._strategy import MeshStrategy

    return MeshStrategy(value, world, options).mesh


def _mesh_value(mesh_dims: Any, devices: Sequence[str] | None, roles: Any = None) -> Mesh:
    if isinstance(mesh_dims, (str, bytes)) or not isinstance(mesh_dims, Sequence) or not all(
            isinstance(d, (tuple, list)) and len(d) == 2 for d in mesh_dims):
        raise ValueError("Invalid `mesh_dims`: expected a list of (axis_name, size) pairs such as "
                         f"[('batch', 2), ('model', 2)], received mesh_dims={mesh_dims!r}.")
    device_type = "cpu"
    if devices is not None:
        if isinstance(devices, str) or not isinstance(devices, Sequence) or not devices:
            raise ValueError("Invalid `devices`: expected a non-empty list such as ['cpu:0', 'cpu:1'], received "
                             f"devices={devices!r}.")
        kinds = {str(d).lower().lstrip("/").split(":")[0].replace("gpu", "cuda") for d in devices}
        if len(kinds) != 1 or not kinds <= {"cpu", "cuda"}:
            raise ValueError(f"Invalid `devices`: expected devices of one kind ('cpu:N' or 'cuda:N'), received "
                             f"devices={list(devices)!r}.")
        device_type = kinds.pop()
    if roles is not None and not isinstance(roles, Mapping):
        raise ValueError(f"Invalid `roles`: expected a dict from axis name to role such as {{'dp': 'data'}}, "
                         f"received roles={roles!r}.")
    value = Mesh(tuple(d[0] for d in mesh_dims), tuple(d[1] for d in mesh_dims), device_type, roles=roles)
    if devices is not None and len(devices) != value.size:
        raise ValueError(f"Invalid `devices`: the mesh {value!r} needs {value.size} devices, received "
                         f"{len(devices)}: {list(devices)!r}. List {value.size} devices, or change the axis sizes.")
    return value


def _form_world(value: Mesh, devices: Sequence[str] | None, options: CommunicationOptions | None,
                ) -> tuple[World, CommunicationOptions]:
    """The `World` the mesh's processes form, as the mirrored strategies form theirs."""
    if replica_identity() is not None:  # a replica a plain-script mesh started
        parsed, options = local_devices(list(devices or []) or None, options)
        return form_local_world(parsed, options), options
    if dist.is_initialized() or resolve_cluster() is not None:
        options = options if options is not None else CommunicationOptions()
        return form_cluster_world(options), options
    if value.size > 1 and devices is None:
        raise ValueError(f"Invalid mesh {value!r}: it needs {value.size} processes but this one was started alone. "
                         f"Pass devices=[...] with {value.size} local devices (the others are started for you), "
                         f"or start the job with `meshfit launch --workers {value.size}` or torchrun.")
    if value.size > 1 and devices is not None:  # (None was refused above)
        # the options the replicas it starts derive too (local_devices' defaults): they must agree
        parsed, options = local_devices(list(devices), options)
        return form_local_world(parsed, options), options
    options = options if options is not None else CommunicationOptions()
    return form_cluster_world(options), options
