"""A checkpoint's snapshot: this rank's tensors for DCP, the document rank 0 writes, and who writes.

`take_snapshot` encodes every trackable's state (tensors apart, the rest as tagged JSON), computes
this rank's part of each shared tensor's digest, and makes the save's one gather: every rank's digests,
path, per-rank trees and whether its part could be written by the chief (`_chief_alone.py`), with rank
0's outcome of preparing the scratch directory. From it every rank decides alike: one shared
checkpoint, each rank its own whole copy (`_own_copies.py`), or the chief alone.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from meshfit._storage import chief_writes
from meshfit._storage import tagged_json as _tree
from meshfit.train import _storage
from meshfit.train._chief_alone import chief_can_write_alone
from meshfit.train._digest import agreed_record, local_record
from meshfit.train._digest_names import digest_paths, optimizer_steps
from meshfit.train._own_copies import is_sharded, refuse_different_paths, whole_tensors
from meshfit.train._per_rank import drop_buffers_rank_0_saves, module_buffer_keys
from meshfit.train._store import scratch


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What a save writes, on this rank.

    Attributes:
        tensors: this rank's tensors for DCP, by key (with own copies: its whole copy).
        document: the JSON state rank 0 writes (per-rank trees gathered, the agreed digest).
        own_paths: every rank's path when they differ (each rank writes a whole copy), else None.
        alone: this rank's per-rank keys when rank 0 writes the checkpoint alone, else None.
    """

    tensors: dict[str, torch.Tensor]
    document: dict[str, Any]
    own_paths: list[str] | None
    alone: list[str] | None


def take_snapshot(trackables: Mapping[str, tuple[Any, bool]], path: str, prepare: Callable[[], None], world: Any,
                  header: dict[str, Any]) -> Snapshot:
    """This rank's `Snapshot` of ``trackables`` for a save to ``path`` (collective under a process group).

    Rank 0 runs ``prepare`` (the scratch directory the ranks write into) before the one gather of
    the ranks' digests, which also carries its outcome: every rank raises if it failed.
    Sharded state must be saved to one path: a checkpoint whose shards went to different folders
    would look complete and fail to restore, so differing paths are an error on every rank.
    ``header`` starts the document (the checkpoint format and version).
    """
    rank, distributed = world.rank, world.distributed
    group = world.control()
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict[str, Any]] = {}
    own_per_rank: dict[str, Any] = {}
    owners: dict[str, str] = {}
    buffers: set[str] = set()  # rank 0's copy is saved; not compared across ranks
    per_rank_keys: list[str] = []
    buffers_of: list[tuple[Any, list[str]]] = []  # shared modules' tensors, for rank 0's buffers
    for name, (target, per_rank) in trackables.items():
        kind = "tensor" if isinstance(target, torch.Tensor) else "stateful"
        state = target.detach() if kind == "tensor" else target.state_dict()
        prefix = f"{name}/rank{rank}" if per_rank else name
        before = set(tensors)
        tree = _tree.encode(state, prefix, tensors, name)
        entries[name] = {"kind": kind, "per_rank": per_rank}
        if per_rank:
            own_per_rank[name] = tree
            per_rank_keys += [k for k in tensors if k not in before]
        else:
            entries[name]["state"] = tree
            added = [k for k in tensors if k not in before]
            owners.update(dict.fromkeys(added, name))
            buffers |= module_buffer_keys(target, added)
            buffers_of.append((target, added))
    size = dist.get_world_size(group) if distributed else 1
    # each shared tensor's digest part (on its device): the ranks' copies are compared, the sum recorded
    digests = local_record(tensors, list(owners), rank)
    shared = {name: target for name, (target, per_rank) in trackables.items() if not per_rank}
    steps = optimizer_steps(shared)  # `state_digest` counts the step count too: so does the record
    digests.update(local_record(steps, list(steps), rank))
    gathered: list[dict[str, Any]] = []

    def gather(prepared: str) -> list[str]:  # rank 0's outcome of `prepare` travels with the digests
        mine = json.dumps({"path": path, "trees": own_per_rank, "digests": digests,
                           "sharded": is_sharded(tensors), "alone": chief_can_write_alone(tensors),
                           "prepared": prepared})
        gathered.extend(json.loads(t) for t in (_storage.all_gather_text(mine, group) if distributed else [mine]))
        return [g["prepared"] for g in gathered]

    chief_writes(prepare, is_chief=rank == 0, gather=gather,
                 what=f"save the checkpoint: rank 0 could not prepare {path!r}")
    paths = [g["path"] for g in gathered]
    own_copies = len(set(paths)) > 1
    if own_copies and any(g["sharded"] for g in gathered):
        if rank == 0:
            shutil.rmtree(scratch(path), ignore_errors=True)
        refuse_different_paths(paths)
    if own_copies:
        tensors = whole_tensors(tensors, per_rank_keys, group)
    elif rank != 0:  # one shared checkpoint: rank 0's buffers are saved, whatever DCP's dedup would pick
        for target, added in buffers_of:
            drop_buffers_rank_0_saves(target, added, tensors)
    for name in own_per_rank:
        entries[name]["ranks"] = [g["trees"][name] for g in gathered]
    record = agreed_record([g["digests"] for g in gathered], buffers, owners, world.failure.step or 0,
                           digest_paths(shared, owners))
    document = {**header, "world_size": size, "trackables": entries, "digest": record}
    alone = distributed and not own_copies and all(g["alone"] for g in gathered)
    return Snapshot(tensors, document, paths if own_copies else None, per_rank_keys if alone else None)
