"""`MultiWorkerMirroredStrategy`: synchronous data parallelism across workers (hosts or processes)."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from meshfit.cluster import parse_address, resolve_cluster
from meshfit.distribute._collective import CollectiveStrategy, group_resolver, join_world, local_resolver
from meshfit.distribute._values import CommunicationOptions
from meshfit.distribute._world import World


class MultiWorkerMirroredStrategy(CollectiveStrategy):
    """One replica per worker process; each worker learns its role from ``TF_CONFIG``.

    The cluster comes from ``cluster_resolver``, else from the environment: ``TF_CONFIG`` (as in
    TensorFlow), torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``, or SLURM.
    Without any, the strategy trains alone (one replica) and ``cluster_resolver`` is a
    `SingleProcessClusterResolver` (``task_type`` and ``task_id`` ``None``, as TensorFlow's without
    ``TF_CONFIG``). A process group the user already initialised is used as it is. Workers
    rendezvous at the chief's address (the ``chief`` task, or worker 0).

    Args:
        communication_options: backend (RING = gloo, NCCL, AUTO), collective timeout, heartbeat.
        cluster_resolver: a resolver from `meshfit.cluster` (default: resolved from the environment).

    Example:
        >>> strategy = MultiWorkerMirroredStrategy()  # no TF_CONFIG: a single worker
        >>> strategy.num_replicas_in_sync
        1
    """

    def __init__(self, communication_options: CommunicationOptions | None = None,
                 cluster_resolver: Any = None, world: World | None = None) -> None:
        options = communication_options if communication_options is not None else CommunicationOptions()
        if world is None:
            if not isinstance(options, CommunicationOptions):
                raise TypeError("Invalid `communication_options`: expected meshfit.CommunicationOptions, "
                                f"received {communication_options!r}.")
            world = form_cluster_world(options, cluster_resolver)
        super().__init__(options, world)


def form_cluster_world(options: CommunicationOptions, cluster_resolver: Any = None) -> World:
    """The `World` of a worker the environment describes (``TF_CONFIG``, torchrun, SLURM), of a group
    the user initialised, or of a process alone."""
    if cluster_resolver is None and not dist.is_initialized():
        cluster_resolver = resolve_cluster()
    formed = World.process_group_shape()
    if formed is not None:
        rank, size, _ = formed
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        world = join_world(options, rank, size, None, local_rank=local_rank, cluster_resolver=cluster_resolver)
        if cluster_resolver is None:
            world.cluster_resolver = group_resolver(local_rank)
        return world
    if cluster_resolver is None:
        return join_world(options, 0, 1, None, cluster_resolver=local_resolver(0, 1, None))
    if cluster_resolver.task_type == "evaluator":
        # The evaluator is not part of the training group: it evaluates checkpoints on its own.
        return World(is_chief=False, cluster_resolver=cluster_resolver)
    names, own_host, training = _describe(cluster_resolver)
    world = join_world(options, cluster_resolver.rank, cluster_resolver.world_size,
                       (cluster_resolver.master_addr, cluster_resolver.master_port),
                       local_rank=getattr(cluster_resolver, "local_rank", None) or 0, names=names,
                       own_host=own_host, settings={"training_tasks": training}, cluster_resolver=cluster_resolver)
    world.is_chief = bool(cluster_resolver.is_chief)
    return world


def _describe(resolver: Any) -> tuple[list[str], str | None, list[str | None]]:
    """Each rank's description ("worker 1 at 10.0.0.2:2222"), this worker's host, the training tasks."""
    spec = resolver.cluster_spec()
    spec = spec.as_dict() if hasattr(spec, "as_dict") else spec
    tasks = [(job, i, address) for job in ("chief", "worker") for i, address in enumerate(spec.get(job, []))]
    if len(tasks) != resolver.world_size:
        tasks = [("rank", r, None) for r in range(resolver.world_size)]
    names = [f"{job} {i} at {address}" if address else f"{job} {i}" for job, i, address in tasks]
    own = tasks[resolver.rank][2]
    own_host = parse_address(own, "task", "cluster")[0] if own else None
    return names, own_host, [address for _, _, address in tasks]
