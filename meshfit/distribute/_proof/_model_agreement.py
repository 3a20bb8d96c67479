"""Checking that every worker built the same model before the first collective on its tensors.

A worker that built a wider layer would otherwise meet the others in a broadcast or an all-reduce of
another size: gloo aborts the process (``EnforceNotMet``, SIGABRT) and its peers report a dead worker.
Instead each worker describes its tensors in order (name, shape, dtype); one all-gather of a digest
compares them, and only on a mismatch a second gathers the descriptions so that every worker raises
the same `ClusterMismatchError` naming the first difference and each worker's value.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from meshfit.distribute._liveness._rendezvous import ClusterMismatchError

Entry = tuple[str, tuple[int, ...], str]  # (name, shape, dtype)


def describe(named: Sequence[tuple[str, torch.Tensor]]) -> list[Entry]:
    """``(name, shape, dtype)`` of each tensor, in order."""
    return [(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")) for name, tensor in named]


def module_entries(module: torch.nn.Module) -> list[Entry]:
    """A module's parameters, then its buffers, as `describe` entries (``parameter 1.weight``...)."""
    return describe([(f"parameter {name!r}", p) for name, p in module.named_parameters()]
                    + [(f"buffer {name!r}", b) for name, b in module.named_buffers()])


def agree_on_tensors(gather: Any, entries: list[Entry], what: str, fix: str) -> None:
    """Raise on every worker if the workers' ``entries`` differ; one small all-gather when they agree.

    Args:
        gather: the strategy's ``all_gather_object`` (every worker calls it at the same point).
        entries: this worker's `describe` entries.
        what: what differs, for the message (e.g. ``"models"``).
        fix: the last sentence of the message.

    Raises:
        ClusterMismatchError: naming the first differing entry and each worker's value.
    """
    digest = hashlib.sha256(repr(entries).encode()).hexdigest()
    if len(set(gather(digest))) == 1:
        return
    everyone: list[list[Entry]] = gather(entries)
    for index in range(max(len(e) for e in everyone)):
        at = [e[index] if index < len(e) else None for e in everyone]
        if any(a != at[0] for a in at[1:]):
            raise ClusterMismatchError(f"The workers built different {what}, which must be the same on every "
                                       f"worker: {_difference(index, at)}. {fix}")
    raise ClusterMismatchError(f"The workers built different {what} (their descriptions differ). {fix}")


def _difference(index: int, at: list[Entry | None]) -> str:
    present = [a for a in at if a is not None]
    names = {a[0] for a in present}
    if len(names) == 1 and len(present) == len(at):  # every worker has it, under one name
        (name,) = names
        return f"{name}: " + ", ".join(f"worker {r} has shape {_shape(a[1])} {a[2]}" for r, a in enumerate(present))
    return f"tensor #{index + 1}: " + ", ".join(
        f"worker {r} has " + ("none" if a is None else f"{a[0]} of shape {_shape(a[1])} {a[2]}")
        for r, a in enumerate(at))


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"
