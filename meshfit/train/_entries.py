"""Restore-side checks of a checkpoint's saved entries: each tracked name's entry, each tensor's destination."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshfit._storage import CorruptFileError


def entry_for(saved: dict, name: str, target: Any, per_rank: bool, path: str) -> dict:
    """The saved entry for ``name``, checked against how it is tracked now."""
    entry = saved.get(name)
    if not isinstance(entry, dict):
        raise ValueError(f"Checkpoint {path!r} has no entry {name!r}; it holds {sorted(saved)}.")
    kind = "tensor" if isinstance(target, torch.Tensor) else "stateful"
    if entry.get("kind") != kind or bool(entry.get("per_rank")) != per_rank:
        raise ValueError(
            f"Checkpoint {path!r} saved {name!r} as kind={entry.get('kind')!r}, "
            f"per_rank={entry.get('per_rank')!r}; it is tracked now as kind={kind!r}, per_rank={per_rank}. "
            "Track it the same way (wrap it in PerRank, or not) as when it was saved.")
    if per_rank and not (isinstance(entry.get("ranks"), list) and entry["ranks"]):
        raise CorruptFileError(f"Corrupt checkpoint {path!r}: per-rank entry {name!r} has no ranks.")
    if not per_rank and "state" not in entry:
        raise CorruptFileError(f"Corrupt checkpoint {path!r}: entry {name!r} has no state.")
    return entry


def destination(stored: Any, current: Any, key: str, path: str) -> torch.Tensor:
    """The tensor DCP loads ``key`` into: the current one if it fits (in place), else a new CPU one."""
    if not isinstance(stored, TensorStorageMetadata):
        raise CorruptFileError(f"Corrupt checkpoint {path!r}: tensor {key!r} is missing from its DCP metadata.")
    if (isinstance(current, torch.Tensor) and tuple(current.shape) == tuple(stored.size)
            and current.dtype == stored.properties.dtype):
        return current.detach()
    return torch.empty(tuple(stored.size), dtype=stored.properties.dtype)
