"""Strategies: how a training step runs on one or many devices and workers."""

from meshfit.distribute._collective import CollectiveStrategy
from meshfit.distribute._distributed_dataset import DistributedDataset
from meshfit.distribute._heartbeat import PEER_FAILURE_EXIT_CODE, PeerFailureError
from meshfit.distribute._mirrored import MirroredStrategy
from meshfit.distribute._multi_worker import MultiWorkerMirroredStrategy
from meshfit.distribute._strategy import OneDeviceStrategy, Strategy, get_strategy
from meshfit.distribute._values import (
    CommunicationImplementation,
    CommunicationOptions,
    InputContext,
    PerReplica,
    ReduceOp,
)

__all__ = [
    "PEER_FAILURE_EXIT_CODE",
    "CollectiveStrategy",
    "CommunicationImplementation",
    "CommunicationOptions",
    "DistributedDataset",
    "InputContext",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "PeerFailureError",
    "PerReplica",
    "ReduceOp",
    "Strategy",
    "get_strategy",
]
