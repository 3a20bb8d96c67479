"""Checkpoints: `Checkpoint`, `CheckpointManager`, `latest_checkpoint`, `load_checkpoint` (torch.distributed.checkpoint)."""

from meshfit.train._checkpoint import Checkpoint
from meshfit.train._manager import CheckpointManager, latest_checkpoint
from meshfit.train._per_rank import PerRank
from meshfit.train._reader import CheckpointReader, load_checkpoint
from meshfit.train._save_future import SaveFuture

__all__ = [
    "Checkpoint", "CheckpointManager", "CheckpointReader", "PerRank", "SaveFuture", "latest_checkpoint",
    "load_checkpoint",
]
