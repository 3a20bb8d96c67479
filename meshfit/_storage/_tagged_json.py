"""The one tagged-JSON codec: a state dict split into tensors and a JSON tree, and joined back.

Used by checkpoints (the tensors go to DCP, the tree to ``meshfit_state.json``) and by
``Model.save``'s optimizer state (the tensors go to ``optimizer.safetensors``, the tree to
``config.json``). The JSON tree mirrors the state dict. Every JSON object in it is a tagged node,
so a tree decodes without guessing and without unpickling, and it is strict JSON
(``json.dumps(tree, allow_nan=False)`` works):

- ``null``, booleans, finite numbers, strings and arrays (python lists) stand for themselves;
- ``{"float": "nan" | "inf" | "-inf"}`` is a non-finite float;
- ``{"dict": [[key, value], ...]}`` is a dict. Pairs, not a JSON object, so that keys keep their
  type: an optimizer's ``state`` has int keys (``[[0, ...]]``), a module's has str keys. A dict that
  carries torch's ``_metadata`` attribute (module state dicts) adds ``"metadata": <tree>``;
- ``{"tuple": [...]}`` is a tuple (e.g. Adam's ``betas``);
- ``{"bytes": "<base64>"}`` is a ``bytes`` value;
- ``{"tensor": "<key>"}`` and ``{"ndarray": "<key>"}`` point at a tensor stored by DCP under
  ``<key>``; ``ndarray`` comes back as a numpy array. Keys are the path of ``/``-joined state
  dict keys under a prefix; two leaves mapping to one key are refused, never renamed.
"""

from __future__ import annotations

import base64
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

_SCALARS = (bool, int, float, str, type(None))
_KEY_SEPARATOR = "/"


def _is_ndarray(value: Any) -> bool:
    """True for a numpy array, without importing numpy when the caller never used it."""
    return type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"


def encode(value: Any, prefix: str, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """Encode ``value`` as a JSON tree; tensors go into ``tensors`` under keys starting with ``prefix``.

    Args:
        value: a state dict (or any leaf of one).
        prefix: the DCP key of ``value`` itself; children append ``/<key>``.
        tensors: receives ``{dcp_key: tensor}``.
        where: a human-readable location for error messages (e.g. ``"optimizer"``).

    Raises:
        TypeError: a leaf is of a type that cannot be stored without pickling.
        ValueError: two leaves would be stored under the same DCP key.
    """
    if isinstance(value, torch.Tensor):
        _add(tensors, prefix, value, where)
        return {"tensor": prefix}
    if _is_ndarray(value):
        _add(tensors, prefix, torch.from_numpy(value.copy()), where)
        return {"ndarray": prefix}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, Mapping):
        pairs = []
        for key, item in value.items():
            if not isinstance(key, _SCALARS):
                raise TypeError(
                    f"Cannot save {where}: state dict key {key!r} has type "
                    f"{type(key).__name__}; expected str, int, float, bool or None keys.")
            child = _join(prefix, key)
            pairs.append([key, encode(item, child, tensors, f"{where}[{key!r}]")])
        node: dict[str, Any] = {"dict": pairs}
        metadata = getattr(value, "_metadata", None)
        if metadata is not None:
            node["metadata"] = encode(metadata, _join(prefix, "_metadata"), tensors, where)
        return node
    if isinstance(value, (list, tuple)):
        items = [encode(item, _join(prefix, i), tensors, f"{where}[{i}]")
                 for i, item in enumerate(value)]
        return {"tuple": items} if isinstance(value, tuple) else items
    raise TypeError(
        f"Cannot save {where} (stored as {prefix!r}): value of type "
        f"{type(value).__module__}.{type(value).__qualname__} "
        "is not a tensor, numpy array, bytes, str, int, float, bool, None, list, tuple or dict. "
        "Convert it in state_dict() (e.g. to a tensor or a list) so it can be saved without pickling.")


def _join(prefix: str, key: Any) -> str:
    """The storage key of ``key`` under ``prefix`` (no leading separator at the root)."""
    return f"{prefix}{_KEY_SEPARATOR}{key}" if prefix else str(key)


def _add(tensors: dict[str, torch.Tensor], key: str, tensor: torch.Tensor, where: str) -> None:
    """Record ``tensor`` under ``key``, refusing silent collisions (``{"a/b": x}`` vs ``{"a": {"b": y}}``)."""
    if key in tensors:
        raise ValueError(f"Cannot save {where}: two entries map to the same storage key {key!r}; "
                         "rename a state dict key that contains '/'.")
    tensors[key] = tensor


def decode(node: Any, load: Callable[[str, bool], Any], where: str) -> Any:
    """Rebuild a value from its JSON tree; ``load(key, as_ndarray)`` returns the stored tensor.

    Raises:
        ValueError: the tree is malformed (the checkpoint is corrupt).
    """
    if isinstance(node, _SCALARS):
        return node
    if isinstance(node, list):
        return [decode(item, load, where) for item in node]
    if not isinstance(node, dict) or len(node) == 0:
        raise ValueError(f"Corrupt saved state for {where}: unexpected node {node!r}.")
    if "tensor" in node:
        return load(node["tensor"], False)
    if "ndarray" in node:
        return load(node["ndarray"], True)
    if "bytes" in node:
        return base64.b64decode(node["bytes"])
    if "float" in node:
        if node["float"] not in ("nan", "inf", "-inf"):
            raise ValueError(f"Corrupt saved state for {where}: bad float node {node!r}.")
        return float(node["float"])
    if "tuple" in node:
        return tuple(decode(item, load, where) for item in node["tuple"])
    if "dict" in node:
        result: dict[Any, Any] = OrderedDict() if "metadata" in node else {}
        for pair in node["dict"]:
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError(f"Corrupt saved state for {where}: bad dict item {pair!r}.")
            result[pair[0]] = decode(pair[1], load, f"{where}[{pair[0]!r}]")
        if "metadata" in node:
            result._metadata = decode(node["metadata"], load, where)  # type: ignore[attr-defined]
        return result
    raise ValueError(f"Corrupt saved state for {where}: unknown node tags {sorted(node)}.")


def tensor_refs(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[str, tuple[Any, ...]]]:
    """List ``(dcp_key, path)`` for every tensor in a JSON tree; ``path`` indexes the state dict."""
    if isinstance(node, list):
        return [ref for i, item in enumerate(node) for ref in tensor_refs(item, (*path, i))]
    if not isinstance(node, dict):
        return []
    if "tensor" in node:
        return [(node["tensor"], path)]
    if "ndarray" in node:
        return [(node["ndarray"], path)]
    if "tuple" in node:
        return tensor_refs(node["tuple"], path)
    if "dict" in node:
        return [ref for pair in node["dict"] if isinstance(pair, list) and len(pair) == 2
                for ref in tensor_refs(pair[1], (*path, pair[0]))]
    return []


def lookup(value: Any, path: tuple[Any, ...]) -> Any:
    """The element of a (current) state dict at ``path``, or None if there is none."""
    for key in path:
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            return None
    return value
