"""One copy is not a replica: what a replica check can compare, and what it checks instead.

A tensor that a layout keeps in one copy (a fully sharded parameter's shard, its optimizer moments,
every tensor of a single process) has no replica to compare with, so comparing digests across
replicas proves nothing about it. Three checks still can fail:

- **at rest**: each rank's digest of the shards it alone holds, recorded once a check has passed,
  is recomputed before the next step uses them (a bit flipped in between is found there);
- **gathered**: each rank gathers each one-copy parameter (``DTensor.full_tensor``), and the digest
  of what it got must equal the digest of the shards (one rank's bad gather is found there);
- **replicas** along any mesh axis that does hold copies are compared as before (`_verify.py`).

`coverage` says, without a collective, which tensors of a state have copies and which do not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from meshfit._protocols import Residency
from meshfit.distribute._proof._digest import finish_digest
from meshfit.distribute._proof._digest_batch import local_parts
from meshfit.distribute._residency import EVERYWHERE


@dataclasses.dataclass(frozen=True)
class ReplicaCoverage:
    """Which tensors of a training state a replica check compares across copies, and which it cannot.

    Attributes:
        compared: paths held in two or more copies of each shard: compared across the copies.
        one_copy: paths held in one copy (of each shard): checked at rest and, for the
            parameters in ``gathered``, after gathering; never reported as agreed replicas.
        gathered: the one-copy parameters whose gathered value every rank checks.
    """

    compared: tuple[str, ...]
    one_copy: tuple[str, ...]
    gathered: tuple[str, ...]

    def describe(self, where: str) -> str:
        """One paragraph for the chief's log when ``fit`` starts: what is and is not compared."""
        total = len(self.compared) + len(self.one_copy)
        if not self.one_copy:
            return (f"VerifyReplicas: under {where}, all {total} tensors of the training state are held in "
                    "two or more copies; every check compares the copies.")
        shown = ", ".join(repr(p) for p in self.one_copy[:4]) + (", ..." if len(self.one_copy) > 4 else "")
        text = (f"VerifyReplicas: under {where}, {len(self.one_copy)} of {total} tensors of the training state "
                f"are held in one copy ({shown}): there is no replica to compare them with. They are checked at "
                "rest instead (each rank's digest of its shards, recorded when a check passes, is checked again "
                "before the next step uses them)")
        if self.gathered:
            text += (f", and {len(self.gathered)} parameter(s) after gathering (every rank's gathered value "
                     "against the digest of the shards)")
        if self.compared:
            return text + f". {len(self.compared)} tensor(s) with copies are compared across their copies."
        return text + ". No tensor has a second copy: nothing is compared across replicas."


def holders(tensor: torch.Tensor, processes: int) -> int:
    """How many processes hold a copy of each of the tensor's shards (a plain tensor: every process).

    A DTensor is copied along the mesh axes it is replicated on (or holds a pending sum on), and a
    sub-mesh of the processes (fully sharded's ``batch`` of a 2-D mesh) has one instance per
    coordinate of the other axes. Any other placement (``Shard``; fully sharded's ``_StridedShard`` over
    tensor parallelism, not a ``Shard`` subclass in torch 2.13) splits the tensor.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        along = math.prod(mesh.size(i) for i, p in enumerate(tensor.placements) if _copies(p))
        return along * max(1, processes // mesh.size())
    return processes


def _copies(placement: Any) -> bool:
    from torch.distributed.tensor.placement_types import Partial, Replicate

    return isinstance(placement, (Replicate, Partial))


def is_gatherable(tensor: torch.Tensor) -> bool:
    """A DTensor split along some mesh axis: its full value is what each rank computes with."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor) and not all(_copies(p) for p in tensor.placements)


def coverage(state: Sequence[tuple[str, torch.Tensor]], parameters: set[str], processes: int,
             residency: Residency = EVERYWHERE) -> ReplicaCoverage:
    """The `ReplicaCoverage` of ``state`` (``(path, tensor)``) on ``processes`` processes; no collective.

    A path some ranks hold (``residency``: a pipeline stage's) has copies only among those ranks.
    """
    counts = {path: holders(tensor, len(residency.holders(path)) or processes) for path, tensor in state}
    compared = tuple(path for path, _ in state if counts[path] > 1)
    one_copy = tuple(path for path, _ in state if counts[path] <= 1)
    gathered = tuple(path for path, tensor in state
                     if counts[path] <= 1 and path in parameters and is_gatherable(tensor))
    return ReplicaCoverage(compared, one_copy, gathered)


GATHER_BYTES = 64 * 2**20  # gathered values held at once: a fully sharded model need not fit whole


def gathered_digests(tensors: Sequence[torch.Tensor]) -> list[int]:
    """This rank's digest of each tensor's gathered value (collective over each tensor's mesh, in order).

    The gathered values are digested in groups of at most `GATHER_BYTES` (one tensor alone may be
    larger) and freed: the whole model is never gathered at once.
    """
    digests: list[int] = []
    group: list[torch.Tensor] = []
    held = 0

    def flush() -> None:
        nonlocal held
        if group:
            values, parts = local_parts(group, 0)  # a plain tensor: its whole value
            digests.extend(finish_digest(value, part.meta) for value, part in zip(values, parts, strict=True))
            group.clear()
            held = 0

    with torch.no_grad():
        for tensor in tensors:
            full = tensor.full_tensor()  # type: ignore[attr-defined]
            if group and held + full.numel() * full.element_size() > GATHER_BYTES:
                flush()
            group.append(full)
            held += full.numel() * full.element_size()
        flush()
    return digests


@dataclasses.dataclass
class AtRest:
    """Each rank's digest parts of the tensors it alone holds, recorded at ``step``, by path."""

    step: int
    paths: list[str]
    values: list[int]

    @classmethod
    def record(cls, step: int, state: Sequence[tuple[str, torch.Tensor]], one_copy: Sequence[str],
               rank: int) -> AtRest:
        wanted = set(one_copy)
        chosen = [(path, tensor) for path, tensor in state if path in wanted]
        values, _ = local_parts([tensor for _, tensor in chosen], rank)
        return cls(step, [p for p, _ in chosen], values)

    def changed(self, state: Sequence[tuple[str, torch.Tensor]], rank: int) -> list[str]:
        """The paths whose shard on this rank changed since the record (no collective). ``state`` is read
        anew: a ``state_dict`` may hand out new tensors (a layout's view of its shards) each time."""
        now = dict(state)
        paths = [path for path in self.paths if path in now]
        values, _ = local_parts([now[path] for path in paths], rank)
        was = dict(zip(self.paths, self.values, strict=True))
        gone = [path for path in self.paths if path not in now]
        return gone + [path for path, value in zip(paths, values, strict=True) if was[path] != value]


def first_changed(gathered: Sequence[Sequence[str]]) -> tuple[list[tuple[str, list[int]]], list[int]] | None:
    """From every rank's changed paths: ``(path, ranks)`` per changed path, in first-seen order, and
    every rank that found a change; None when no rank did."""
    by_path: dict[str, list[int]] = {}
    for rank, paths in enumerate(gathered):
        for path in paths:
            by_path.setdefault(path, []).append(rank)
    if not by_path:
        return None
    ranks = sorted({rank for found in by_path.values() for rank in found})
    return list(by_path.items()), ranks

