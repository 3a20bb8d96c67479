"""`state_digest`: one 64-bit digest per tensor of the training state, and of the whole state.

The digest is defined on the logical tensor (see ``meshfit/distribute/_digest.py``): the same state
gives the same digest replicated, fully sharded, on a 2-D mesh or in one process.
"""

from __future__ import annotations

from typing import Any

from meshfit.distribute import (
    StateDigest,
    current_world,
    local_parts,
    named_state,
    reduce_parts,
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
    state, _ = named_state(module, optimizer)
    paths = [path for path, _ in state]
    world = current_world()
    values, parts = local_parts([tensor for _, tensor in state], world.rank)
    return StateDigest(reduce_parts(paths, values, parts, world))
