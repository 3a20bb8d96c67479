"""Small replicated state is written by the chief alone, without DCP's collective planning.

Under data parallel every rank holds the same weights and optimizer state. DCP splits the writing of
such a state between the ranks (each writes part of it, to its own file), and pays for the split with
four collectives of pickled plans and results per save, on every rank's writer thread: on the seed CNN
(11 MB) each of 2 workers spent about 23 ms of writer CPU per save, of which under half wrote data.
When the state is small that split costs more CPU than it saves, so the chief writes the whole
checkpoint as one process does (one data file, no DCP collective), with every other rank's ``PerRank``
tensors (random-number states, metric sums: a few kB) gathered to it first, as safetensors bytes in
one all-gather (pickled through ``all_gather_object`` they cost each writer ~5 ms a save, torch's
pickler and loader per tensor); the other ranks' writers only take part in that gather and in the
commit's.

A large state (above `CHIEF_ALONE_BYTES` on the chief) keeps DCP's split, which spreads the bytes and
the file-system bandwidth over the ranks; sharded state (any DTensor) always does, since no rank holds
all of it. The checkpoint is the same either way: DCP's metadata indexes every tensor by key, and a
restore reads each from whichever file holds it, on any number of ranks.
"""

from __future__ import annotations

import io
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshfit.train import _storage

# Above this many bytes on the chief, the ranks share the writing (DCP's split). A judgment, not a
# measured crossover: on the seed CNN (11 MB) the split's fixed cost (~20 ms of writer CPU on each rank)
# outweighs the chief's extra writing (DCP writes ~1.2 ms of CPU per MB here); at 64 MiB the chief alone
# would spend ~80 ms writing, and the split spreads that over the ranks' writers and disks.
CHIEF_ALONE_BYTES = 64 << 20


def chief_can_write_alone(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether this rank's part of a save could be written by the chief: plain tensors, few bytes in all.

    Every rank answers for itself; the chief writes alone only when every rank said yes (the answers
    travel with the save's one gather, so all ranks decide alike).
    """
    total = 0
    for tensor in tensors.values():
        if isinstance(tensor, DTensor):
            return False
        total += tensor.numel() * tensor.element_size()
    return total <= CHIEF_ALONE_BYTES


def with_every_ranks_own(tensors: dict[str, torch.Tensor], per_rank_keys: list[str],
                         group: Any) -> dict[str, torch.Tensor]:
    """``tensors`` plus every other rank's per-rank tensors, on CPU (collective on ``group``): the
    chief-alone save and the own-copies save (`_own_copies.whole_tensors`) gather them so.

    Each rank's per-rank tensors travel as one blob (``all_gather_bytes``): safetensors, or for a
    dtype safetensors cannot hold, ``torch.save`` (read back with ``weights_only=True``).
    """
    own = {key: tensors[key].detach().cpu().clone(memory_format=torch.contiguous_format) for key in per_rank_keys}
    blobs = _storage.all_gather_bytes(_encode(own), group)
    every = dict(tensors)
    mine = dist.get_rank(group)
    for rank, blob in enumerate(blobs):
        if rank != mine:
            every.update(_decode(blob))
    return every


def _encode(tensors: dict[str, torch.Tensor]) -> bytes:
    try:
        return b"S" + safetensors.torch.save(tensors)
    except (ValueError, TypeError, KeyError):  # e.g. a complex128 tensor: no safetensors dtype
        buffer = io.BytesIO()
        torch.save(tensors, buffer)
        return b"P" + buffer.getvalue()


def _decode(blob: bytes) -> dict[str, torch.Tensor]:
    if blob[:1] == b"S":
        return safetensors.torch.load(blob[1:])
    loaded: dict[str, torch.Tensor] = torch.load(io.BytesIO(blob[1:]), weights_only=True)
    return loaded
