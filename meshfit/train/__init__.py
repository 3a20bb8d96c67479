"""Checkpoints: `Checkpoint`, `CheckpointManager`, `latest_checkpoint`, `load_checkpoint` (torch.distributed.checkpoint)."""

from meshfit._export import publish as _publish

# Seams for meshfit's other packages (not public API: not in __all__).
from meshfit.train._backup import claim_backup_dir as claim_backup_dir
from meshfit.train._backup import delete_backup_dir as delete_backup_dir
from meshfit.train._backup import restore_newest_intact as restore_newest_intact
from meshfit.train._checkpoint import Checkpoint
from meshfit.train._digest import state_digest
from meshfit.train._manager import CheckpointManager, latest_checkpoint
from meshfit.train._per_rank import PerRank
from meshfit.train._reader import CheckpointReader, load_checkpoint
from meshfit.train._save_future import SaveFuture
from meshfit.train._storage import SafeFileSystemReader as SafeFileSystemReader
from meshfit.train._store import CheckpointStore, FileSystemStore

__all__ = [
    "Checkpoint", "CheckpointManager", "CheckpointReader", "CheckpointStore", "FileSystemStore", "PerRank",
    "SaveFuture", "latest_checkpoint", "load_checkpoint", "state_digest",
]

_publish(__name__)
