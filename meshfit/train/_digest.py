"""`state_digest`: one 64-bit digest per tensor of the training state, and of the whole state.

The digest is defined on the logical tensor (see ``meshfit/distribute/_proof/_digest.py``): the same state
gives the same digest replicated, fully sharded, on a 2-D mesh or in one process.
"""

from __future__ import annotations

from typing import Any

import torch

from meshfit._storage import CorruptFileError
from meshfit.distribute import (
    ReplicaDivergenceError,
    StateDigest,
    combine_digests,
    compare_replicas,
    current_world,
    finish_digest,
    local_parts,
    named_state,
    reduce_parts,
    reduce_resident,
    resolve_residency,
    resolve_state,
)


def state_digest(model: Any, optimizer: Any = None) -> StateDigest:
    """The digest of a model's training state, per tensor and in total (collective).

    Covers the module's parameters and buffers (by their ``state_dict`` paths), and the optimizer's
    state as ``optimizer/<param path>/<state name>`` with its step count (``optimizer/iterations``).
    Each tensor's digest is computed on its device from the elements this process holds (their
    global index and bits; no host copy of the tensor) and one sum across processes adds the
    shards, so every process gets the same values, whatever the layout. Under data parallel the
    replicated tensors count once (rank 0's copy); `Strategy.verify_replicas` compares the copies.

    Args:
        model: a `meshfit.Model` (its compiled optimizer is included) or a ``torch.nn.Module``.
        optimizer: a meshfit or torch optimizer to include (default: the Model's own).

    Returns:
        A mapping from each tensor's path to an unsigned 64-bit int, with ``.total`` (the whole
        state's digest, which depends on every path and value but not on their order).

    Raises:
        TypeError: ``model`` or ``optimizer`` is of another kind.
        ValueError: there are no tensors to digest (e.g. a lazy module not built yet).

    Example:
        >>> import torch
        >>> from meshfit.train import state_digest
        >>> torch.manual_seed(0) and None
        >>> layer = torch.nn.Linear(3, 2)
        >>> digest = state_digest(layer)
        >>> sorted(digest), digest.total == state_digest(layer).total
        (['bias', 'weight'], True)
        >>> with torch.no_grad():
        ...     layer.weight[0, 0] += 1
        >>> digest["weight"] != state_digest(layer)["weight"], digest["bias"] == state_digest(layer)["bias"]
        (True, True)
    """
    module, optimizer = resolve_state(model, optimizer)
    residency = resolve_residency(model)
    state, _ = named_state(module, optimizer, residency)
    paths = [path for path, _ in state]
    world = current_world()
    if not residency.everywhere:  # each rank holds some paths (pipeline stages): each from its holders
        return StateDigest(reduce_resident(state, residency, world))
    values, parts = local_parts([tensor for _, tensor in state], world.rank)
    return StateDigest(reduce_parts(paths, values, parts, world))


# ---- checkpoints: the digest recorded at save, recomputed at restore --------------------------------
def local_record(tensors: dict[str, torch.Tensor], keys: list[str], rank: int) -> dict[str, list[Any]]:
    """This rank's part of each shared tensor's digest, by DCP key: [value, shard, canonical, meta]
    (JSON for the one all-gather a save already makes)."""
    values, parts = local_parts([tensors[key] for key in keys], rank)
    return {key: [value, list(part.shard), part.canonical, part.meta]
            for key, value, part in zip(keys, values, parts, strict=True)}


def agreed_record(gathered: list[dict[str, list[Any]]], exempt: set[str], owners: dict[str, str],
                  step: int, names: dict[str, str] | None = None) -> dict[str, Any]:
    """The digest a checkpoint records, once the ranks holding each tensor agree on it.

    Args:
        gathered: every rank's `local_record`, by rank.
        exempt: keys whose copies may differ (module buffers: rank 0's is the one saved).
        owners: the trackable name of each key, for the message.
        step: the optimizer step, for the message.
        names: `state_digest`'s path of the keys that have one (`_digest_names.digest_paths`): the
            record is keyed by them, with ``"keys"`` mapping each back to its DCP key.

    Raises:
        ReplicaDivergenceError: a tensor differs between ranks that should hold the same copy; the
            save is not committed.
    """
    keys = list(gathered[0])
    _refuse_missing(gathered, owners, step)
    found = compare_replicas(keys, [([g[k][0] for k in keys], [g[k][1] for k in keys]) for g in gathered],
                             frozenset(exempt))
    if found is not None:
        key, ranks, detail = found
        name = owners.get(key, key.split("/", 1)[0])
        raise ReplicaDivergenceError(
            step, key, ranks,
            f" ({detail}). A Checkpoint stores one copy of a shared tensor, so the save is not committed. If "
            f"the values are meant to differ per rank, wrap the trackable: Checkpoint({name}=meshfit.train."
            "PerRank(...)); else the replicas lost their agreement: restore the last checkpoint.",
            prefix=f"Cannot checkpoint {name!r}: ")
    names = names or {}
    digests = {names.get(key, key): finish_digest(sum(g[key][0] for g in gathered if g[key][2]), gathered[0][key][3])
               for key in keys}
    record: dict[str, Any] = {"tensors": {path: f"{value:016x}" for path, value in digests.items()},
                              "total": f"{combine_digests(digests):016x}"}
    if names:
        record["keys"] = {path: key for key, path in names.items() if path != key}
    return record


def _refuse_missing(gathered: list[dict[str, list[Any]]], owners: dict[str, str], step: int) -> None:
    """Every rank must hold the same shared tensors: one that some ranks lack is a divergence (optimizer
    state one replica built and another did not), refused by name instead of left out of the record."""
    every = set().union(*(set(g) for g in gathered))
    for key in sorted(every):
        lacking = [rank for rank, g in enumerate(gathered) if key not in g]
        if lacking:
            name = owners.get(key, key.split("/", 1)[0])
            raise ReplicaDivergenceError(
                step, key, lacking,
                f" (held by the other ranks, absent on these). A Checkpoint stores one copy of a shared tensor, so "
                f"the save is not committed. If {name!r} is meant to differ per rank, wrap it: "
                f"Checkpoint({name}=meshfit.train.PerRank(...)); else the replicas lost their agreement: restore "
                "the last checkpoint.", prefix=f"Cannot checkpoint {name!r}: ")


def verify_loaded(destinations: dict[str, torch.Tensor], recorded: Any, world: Any, path: str) -> None:
    """Recompute the digest of what a restore loaded and refuse a mismatch with the recorded one (collective).

    Raises:
        DigestMismatchError: on every rank, naming the checkpoint and the first differing tensor.
    """
    if not isinstance(recorded, dict) or not isinstance(recorded.get("tensors"), dict):
        raise CorruptFileError(f"Corrupt checkpoint {path!r}: its recorded digest is unreadable.")
    stored = recorded.get("keys", {})  # the DCP key of each tensor the record names by its state path
    named = [(name, stored.get(name, name)) for name in recorded["tensors"]]
    named = [(name, key) for name, key in named if key in destinations]
    keys = [key for _, key in named]
    values, parts = local_parts([destinations[key] for key in keys], world.rank)
    loaded = reduce_parts(keys, values, parts, world)  # one sum: every rank reaches the same verdict
    for name, key in named:
        want = int(recorded["tensors"][name], 16)
        if loaded[key] != want:
            raise DigestMismatchError(
                f"Checkpoint {path!r}: tensor {name!r}{f' (stored as {key!r})' if key != name else ''} was loaded "
                f"with digest 0x{loaded[key]:016x}, but the save "
                f"recorded 0x{want:016x} once its replicas agreed. Its data was changed after the save (other "
                "values written with a valid checksum) or a shard was loaded into the wrong place; it is not "
                "restored. Restore an earlier checkpoint.")


class DigestMismatchError(CorruptFileError):
    """What a restore loaded is not what the checkpoint's save recorded (its digest differs)."""
