"""Cluster resolvers: where this process sits in a multi-process job (TF_CONFIG, torchrun, SLURM)."""

from meshfit._export import publish as _publish
from meshfit.cluster._base import ClusterInfo, ClusterResolver

# Seams for meshfit's other packages (not public API: not in __all__).
from meshfit.cluster._base import parse_address as parse_address
from meshfit.cluster._cluster_spec import ClusterSpec
from meshfit.cluster._env_resolvers import (
    DEFAULT_MASTER_PORT,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TorchrunClusterResolver,
)
from meshfit.cluster._hostlist import expand_hostlist
from meshfit.cluster._resolver import resolve_cluster
from meshfit.cluster._single import SingleProcessClusterResolver
from meshfit.cluster._tf_config import TFConfigClusterResolver

__all__ = [
    "DEFAULT_MASTER_PORT",
    "ClusterInfo",
    "ClusterResolver",
    "ClusterSpec",
    "SimpleClusterResolver",
    "SingleProcessClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "expand_hostlist",
    "resolve_cluster",
]

_publish(__name__)
