"""Checkpoints saved to a different path on each rank: TensorFlow's ``write_filepath`` dance.

The seed tutorials save with ``CheckpointManager(checkpoint, directory=write_checkpoint_dir)``, where
the chief's ``write_checkpoint_dir`` is the real directory and every other worker's is its own
temporary one (deleted afterwards). TensorFlow's semantics: every worker writes a complete checkpoint
to the path it was given. meshfit does the same when the state is replicated (every rank holds all
of it): each rank writes a whole, self-contained checkpoint to its own path, with the same atomic
steps as a collective one (scratch directory, CRC-32Cs, ``meshfit_state.json``, rename), and the
ranks agree on the outcome (one all-gather: a failure on any rank raises on every rank, naming it).
Per-rank state (``PerRank``) of every rank is gathered into each copy, so the chief's is complete.
Sharded state (DTensor layouts) has no whole copy on any rank: it needs one shared path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from meshfit.train import _storage
from meshfit.train._chief_alone import with_every_ranks_own


def is_sharded(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether some tensor is only partly on this rank (a DTensor placed other than replicated)."""
    return any(isinstance(t, DTensor) and not all(isinstance(p, Replicate) for p in t.placements)
               for t in tensors.values())


def refuse_different_paths(paths: list[str]) -> None:
    """Sharded state saved to different paths: the shards must meet in one directory."""
    listing = ", ".join(f"rank {r}: {p!r}" for r, p in enumerate(paths))
    raise ValueError(f"Every rank must save a checkpoint to the same path; received {listing}. "
                     "Pass one path (on a file system all workers share) on every rank: a meshfit "
                     "checkpoint is collective, each worker writes its own shards into that one "
                     "directory. Drop TensorFlow's per-worker temp dir (the tutorial's write_filepath "
                     "and the rmtree of it on non-chief workers): save to checkpoint_dir everywhere.")


def whole_tensors(tensors: dict[str, torch.Tensor], per_rank_keys: list[str], group: Any) -> dict[str, torch.Tensor]:
    """This rank's tensors as plain CPU ones, plus every other rank's per-rank tensors (collective)."""
    whole = {k: (t.to_local() if isinstance(t, DTensor) else t).detach().cpu() for k, t in tensors.items()}
    return with_every_ranks_own(whole, per_rank_keys, group)  # in memory between ranks, never read from disk


def save_own_copy(write: Callable[[], None], paths: list[str], rank: int, group: Any) -> None:
    """Run ``write`` (this rank's whole checkpoint); every rank learns every outcome (collective)."""
    status = ""
    try:
        write()
    except Exception as error:  # reported to every rank below, then raised
        status = f"{type(error).__name__}: {error}"
    statuses = _storage.all_gather_text(status, group)
    failed = [f"rank {r} ({paths[r]!r}): {s}" for r, s in enumerate(statuses) if s]
    if failed:
        raise RuntimeError("Could not save the per-worker checkpoints: " + "; ".join(failed))
