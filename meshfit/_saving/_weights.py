"""Model weights and optimizer state as safetensors files: no pickle on save or load.

A weights file is a plain safetensors file (``safetensors.torch``), written atomically through
`meshfit._storage._io`. A torch optimizer's ``state_dict`` (nested dicts keyed by int parameter ids, tensors,
python scalars such as ``momentum_buffer=None``, and ``param_groups`` lists) is split by
`flatten_optimizer_state` into a flat tensor dict (for safetensors) and a JSON-able tree that
references those tensors by name (`meshfit._storage._tagged_json`, the one codec checkpoints use too);
`unflatten_optimizer_state` rebuilds it exactly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import safetensors.torch
import torch

from meshfit._storage import ChecksumError, atomic_write_bytes, tagged_json, tensor_crc32

__all__ = [
    "OPTIMIZER_STATE_FORMAT",
    "flatten_optimizer_state",
    "load_metadata",
    "load_state_dict_file",
    "save_state_dict",
    "unflatten_optimizer_state",
]

OPTIMIZER_STATE_FORMAT = "meshfit.optimizer_state/1"
CHECKSUM_KEY = "meshfit.crc32c"  # header metadata: JSON {tensor name: CRC-32C of its bytes}


def _prepare_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors; a tensor sharing storage with an earlier one is cloned."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise TypeError(
                f"Invalid state dict key {key!r}: expected str keys, received {type(key).__name__}."
            )
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"Invalid state dict entry {key!r}: expected a torch.Tensor, received {type(value).__name__}."
            )
        tensor = value.detach().to("cpu").contiguous()
        if tensor.numel() > 0:
            ptr = tensor.untyped_storage().data_ptr()
            if ptr in seen:
                tensor = tensor.clone()
            else:
                seen.add(ptr)
        out[key] = tensor
    return out


def save_state_dict(
    path: str | os.PathLike[str],
    state: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Saves a flat ``{name: tensor}`` dict as a safetensors file, atomically.

    Tensors are moved to CPU and made contiguous; tensors that share memory (tied weights) are
    stored as separate copies, so every key loads back. The CRC-32C of every tensor is stored in the
    header (``metadata["meshfit.crc32c"]``) and verified by `load_state_dict_file`.

    Args:
        path: Destination file; its parent directory must exist.
        state: Mapping of string keys to tensors, e.g. ``module.state_dict()``.
        metadata: Optional string-to-string metadata stored in the file header.

    Raises:
        TypeError: If a key, value or metadata entry has the wrong type.
    """
    if metadata is not None:
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(
                    f"Invalid `metadata` entry {key!r}: {value!r}: keys and values must both be str. "
                    "Encode other values with json.dumps."
                )
    tensors = _prepare_tensors(state)
    metadata = {**(metadata or {}), CHECKSUM_KEY: json.dumps({k: tensor_crc32(t) for k, t in tensors.items()})}
    data = safetensors.torch.save(tensors, metadata=metadata)
    atomic_write_bytes(path, data)


def _check_file(path: str | os.PathLike[str]) -> str:
    """The path as a str, or FileNotFoundError if there is no such file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No weights file at {path!r}. Check the path (received path={path!r}).")
    return path


def load_state_dict_file(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Loads a safetensors file written by `save_state_dict` into CPU tensors.

    Args:
        path: The file to read.

    Returns:
        The ``{name: tensor}`` dict, in the file's order.

    Raises:
        FileNotFoundError: If ``path`` is not an existing file.
        ValueError: If the file is not a safetensors file or is corrupted (a tensor whose bytes do
            not match the checksum recorded at save time: `meshfit._storage._checksum.ChecksumError`).
    """
    path = _check_file(path)
    try:
        tensors = safetensors.torch.load_file(path, device="cpu")
        with safetensors.safe_open(path, framework="pt") as f:
            recorded = (f.metadata() or {}).get(CHECKSUM_KEY)
        expected = json.loads(recorded) if recorded is not None else {}
    except Exception as err:
        raise ValueError(
            f"Cannot load {path!r}: not a meshfit/safetensors checkpoint or corrupted ({err})."
        ) from err
    for name, crc in expected.items():
        if name not in tensors or tensor_crc32(tensors[name]) != crc:
            raise ChecksumError(f"Corrupt file {path!r}: tensor {name!r} does not match the CRC-32C recorded when "
                                "it was saved (a bit flip or a damaged copy). Restore the file from a good copy.")
    return tensors


def load_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """Reads the string metadata stored in a safetensors file's header (empty dict if none).

    Raises:
        FileNotFoundError: If ``path`` is not an existing file.
        ValueError: If the file is not a safetensors file or is corrupted.
    """
    path = _check_file(path)
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            return {k: v for k, v in (f.metadata() or {}).items() if k != CHECKSUM_KEY}
    except Exception as err:
        raise ValueError(
            f"Cannot load {path!r}: not a meshfit/safetensors checkpoint or corrupted ({err})."
        ) from err


def _tensor_loader(tensors: Mapping[str, torch.Tensor]) -> Any:
    """``load(key, as_ndarray)`` for `meshfit._storage._tagged_json.decode` over a loaded tensor file."""

    def load(key: str, as_ndarray: bool) -> Any:
        if key not in tensors:
            raise ValueError(f"Corrupted optimizer state: tensor {key!r} is missing from the tensor file.")
        return tensors[key].numpy() if as_ndarray else tensors[key]

    return load


def flatten_optimizer_state(
    state_dict: Mapping[str, Any],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Splits a torch optimizer ``state_dict`` into tensors and a JSON-able description.

    Args:
        state_dict: ``torch.optim.Optimizer.state_dict()`` (or any nested dict/list/tuple of
            tensors, numbers, strings, bools and None).

    Returns:
        ``(tensors, meta)``: ``tensors`` maps names like ``"state/0/exp_avg"`` to the (detached,
        not copied) tensors, ready for `save_state_dict`; ``meta`` is plain JSON
        (``json.dumps(meta)`` works) that `unflatten_optimizer_state` turns back into the dict.

    Raises:
        TypeError: If the state holds a value of another type (it is named by its path).

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        >>> tensors, meta = flatten_optimizer_state(opt.state_dict())
        >>> unflatten_optimizer_state(tensors, meta) == opt.state_dict()
        True
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"Invalid `state_dict`: expected a dict from optimizer.state_dict(), "
            f"received {type(state_dict).__name__}."
        )
    tensors: dict[str, torch.Tensor] = {}
    tree = tagged_json.encode(state_dict, "", tensors, "optimizer state")
    return tensors, {"format": OPTIMIZER_STATE_FORMAT, "tree": tree}


def unflatten_optimizer_state(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> dict[str, Any]:
    """Rebuilds the optimizer ``state_dict`` saved by `flatten_optimizer_state`.

    Args:
        tensors: The tensor dict (e.g. from `load_state_dict_file`).
        meta: The JSON description returned by `flatten_optimizer_state` (after a JSON round trip).

    Returns:
        A dict to pass to ``torch.optim.Optimizer.load_state_dict``.

    Raises:
        ValueError: If ``meta`` is not a meshfit optimizer-state description, or names a missing tensor.
    """
    if not isinstance(meta, Mapping) or meta.get("format") != OPTIMIZER_STATE_FORMAT or "tree" not in meta:
        fmt = meta.get("format") if isinstance(meta, Mapping) else type(meta).__name__
        raise ValueError(
            f"Invalid optimizer state description: expected format {OPTIMIZER_STATE_FORMAT!r}, "
            f"received {fmt!r}. Pass the `meta` returned by flatten_optimizer_state."
        )
    state = tagged_json.decode(meta["tree"], _tensor_loader(tensors), "optimizer state")
    if not isinstance(state, dict):
        raise ValueError(f"Corrupted optimizer state: the root is a {type(state).__name__}, not a dict.")
    return state
