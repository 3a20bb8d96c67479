"""Whether a checkpoint fits the module restoring it: the same parameter names and shapes.

A module changed since its checkpoint was saved (a wider layer, one more layer) would fail inside
torch's ``load_state_dict`` with ``size mismatch for 1.weight`` and no word of which checkpoint;
`check_module_fits` says it first, with the checkpoint, the parameter and both shapes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parameter import is_lazy

from meshfit._storage import StateMismatchError

_LISTED = 5  # names listed in a message before "..."


def check_module_fits(name: str, module: torch.nn.Module, refs: list[tuple[str, tuple[Any, ...]]],
                      stored: dict[str, Any], path: str) -> None:
    """Raise `StateMismatchError` if the checkpoint's tensors for ``module`` do not fit it.

    Args:
        name: the trackable's name in the checkpoint.
        module: the module to restore into.
        refs: ``(dcp_key, state_dict_path)`` of every tensor saved for it.
        stored: DCP's metadata by key (``.size`` is the saved shape).
        path: the checkpoint directory, for the message.
    """
    current = module.state_dict()
    saved = {sub_path[0]: key for key, sub_path in refs if len(sub_path) == 1}
    for parameter, key in saved.items():
        tensor, metadata = current.get(parameter), stored.get(key)
        if not isinstance(tensor, torch.Tensor) or is_lazy(tensor) or metadata is None:
            continue
        saved_shape, shape = tuple(metadata.size), tuple(tensor.shape)
        if saved_shape != shape:
            raise StateMismatchError(
                f"Checkpoint {path!r} does not fit {name!r}: parameter {parameter!r} has shape {saved_shape} in "
                f"the checkpoint and {shape} in the module (the model changed since it was saved).")
    tensors = {k for k, v in current.items() if isinstance(v, torch.Tensor)}
    missing, unexpected = sorted(tensors - set(saved)), sorted(set(saved) - tensors)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"the module has {_names(missing)}, which the checkpoint lacks")
        if unexpected:
            parts.append(f"the checkpoint has {_names(unexpected)}, which the module lacks")
        raise StateMismatchError(f"Checkpoint {path!r} does not fit {name!r}: {'; '.join(parts)} (the model "
                                 "changed since it was saved).")


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_LISTED])
    return shown + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")
