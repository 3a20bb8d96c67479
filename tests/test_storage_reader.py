"""The checkpoint reader reads DCP's metadata once: a restore reads it before loading, and DCP's own read
then gets the same object, so a checkpoint that retention deletes in between (an evaluator racing the
trainers' ``keep_checkpoint_max``) fails in the data reads, where the restore names it, instead of in
torch's metadata fallback, which logs a traceback on the root logger first."""

from __future__ import annotations

import os

import torch

from meshfit.train import Checkpoint
from meshfit.train._storage import DCP_METADATA, SafeFileSystemReader


def test_the_metadata_is_read_once_per_reader(tmp_path) -> None:
    path = Checkpoint(model=torch.nn.Linear(2, 1)).save(str(tmp_path / "ckpt-1"))
    reader = SafeFileSystemReader(path)
    first = reader.read_metadata()
    os.remove(os.path.join(path, DCP_METADATA))  # deleted after the restore's own read
    assert reader.read_metadata() is first
    assert "model/weight" in first.state_dict_metadata
