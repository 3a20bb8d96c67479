"""`resolve_cluster`: pick the resolver that matches how this process was started."""

from __future__ import annotations

import os
from collections.abc import Mapping

from meshfit.cluster._base import ClusterResolver
from meshfit.cluster._env_resolvers import SlurmClusterResolver, TorchrunClusterResolver
from meshfit.cluster._tf_config import TFConfigClusterResolver


def _slurm_multi_task(env: Mapping[str, str]) -> bool:
    if "SLURM_PROCID" not in env:
        return False
    tasks = env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "")).strip()
    try:
        return int(tasks) > 1
    except ValueError:
        # Set but unreadable: let the resolver explain; unset: not a multi-task step.
        return bool(tasks)


def resolve_cluster(environ: Mapping[str, str] | None = None) -> ClusterResolver | None:
    """Return the cluster resolver for this process, or ``None`` for a single process.

    Checked in order: ``TF_CONFIG`` (non-empty) → `TFConfigClusterResolver`; ``RANK`` and
    ``WORLD_SIZE`` (torchrun) → `TorchrunClusterResolver`; ``SLURM_PROCID`` with
    ``SLURM_NTASKS`` > 1 → `SlurmClusterResolver`; otherwise ``None``.

    Args:
        environ: the environment to read; ``None`` reads ``os.environ``.

    Returns:
        A resolver, or ``None`` when nothing describes a multi-process job.

    Raises:
        ValueError: the chosen source is malformed (the message names the variable and the fix).

    Example:
        >>> resolve_cluster({}) is None
        True
        >>> resolve_cluster({"RANK": "0", "WORLD_SIZE": "1"}).world_size
        1
    """
    env = os.environ if environ is None else environ
    tf_config = env.get("TF_CONFIG", "")
    if tf_config.strip():
        return TFConfigClusterResolver(tf_config)
    if "RANK" in env and "WORLD_SIZE" in env:
        return TorchrunClusterResolver(env)
    if _slurm_multi_task(env):
        return SlurmClusterResolver(env)
    return None
