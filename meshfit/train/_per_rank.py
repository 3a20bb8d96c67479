"""`PerRank`: marks a trackable whose state is different on every rank."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from meshfit._protocols import Stateful


def is_trackable(value: Any) -> bool:
    """True for a tensor or an object with callable ``state_dict`` and ``load_state_dict``."""
    return isinstance(value, (torch.Tensor, Stateful))


class PerRank:
    """Wraps a trackable whose state differs per rank (RNG streams, a per-replica data position).

    ``Checkpoint`` saves such a trackable once per rank (its tensors under ``<name>/rank<r>/...``,
    its other values in ``"ranks"[r]`` of the JSON state) and on restore rank ``r`` loads its own.
    When the checkpoint was written by fewer (or more) ranks than restore it, rank ``r`` loads the
    state saved by rank ``r % saved_world_size``.

    Args:
        trackable: an object with ``state_dict()`` / ``load_state_dict()``, or a ``torch.Tensor``.

    Raises:
        TypeError: ``trackable`` is not trackable (or is itself a ``PerRank``).

    Example:
        >>> import torch
        >>> from meshfit.train import Checkpoint, PerRank
        >>> class TorchRNG:
        ...     def state_dict(self):
        ...         return {"cpu": torch.get_rng_state()}
        ...     def load_state_dict(self, state):
        ...         torch.set_rng_state(state["cpu"])
        >>> ckpt = Checkpoint(rng=PerRank(TorchRNG()))
    """

    def __init__(self, trackable: Any) -> None:
        if isinstance(trackable, PerRank) or not is_trackable(trackable):
            raise TypeError(
                "Invalid `trackable` for PerRank: expected a torch.Tensor or an object with state_dict() "
                f"and load_state_dict(), received {type(trackable).__name__} {trackable!r:.80}.")
        self.trackable = trackable

    def __repr__(self) -> str:
        return f"PerRank({self.trackable!r:.80})"


def module_buffer_keys(target: Any, keys: list[str]) -> set[str]:
    """The keys among ``keys`` (``<name>/<path>``) that are plain buffers of ``target``, a module.

    DDP broadcasts a module's buffers from rank 0 at every forward, so rank 0's copy is the one
    training uses (e.g. batch-norm statistics); other ranks' copies may differ after a step. A
    `Checkpoint` writes these from rank 0 only (DCP would otherwise write a tensor every rank
    holds from whichever rank's plan is smallest), and does not compare them across ranks.
    """
    if not isinstance(target, torch.nn.Module):
        return set()
    state_keys = set(target.state_dict(keep_vars=True))
    buffers = {name for name, _ in target.named_buffers() if name in state_keys}
    return {key for key in keys if key.split("/", 1)[-1] in buffers}


def drop_buffers_rank_0_saves(target: Any, keys: list[str], tensors: dict[str, torch.Tensor]) -> None:
    """On a rank other than 0: remove ``target``'s plain buffers from the tensors it writes."""
    for key in module_buffer_keys(target, keys):
        if not isinstance(tensors[key], DTensor):
            del tensors[key]
