"""Nested structures of tensors (tuples, lists, dicts): map, stack and slice them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch


def to_tensor(value: Any) -> Any:
    """Convert the leaves of a structure to torch tensors (numpy arrays without a copy)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "US":
            return value
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, dict):
        return {k: to_tensor(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(to_tensor(v) for v in value)
    if isinstance(value, list):
        if value and all(isinstance(v, (torch.Tensor, np.ndarray, dict, tuple, list)) for v in value):
            return tuple(to_tensor(v) for v in value)  # a DataLoader's [x, y] batch
        if value and all(isinstance(v, str) for v in value):
            return np.asarray(value)
        return torch.as_tensor(np.asarray(value))
    if isinstance(value, (int, float, bool)):
        return torch.as_tensor(value)
    return value


def map_structure(fn: Callable[[Any], Any], value: Any) -> Any:
    """Apply ``fn`` to every leaf."""
    if isinstance(value, dict):
        return {k: map_structure(fn, v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(map_structure(fn, v) for v in value)
    return fn(value)


def leaves(value: Any) -> list[Any]:
    """The leaves of a structure, depth first."""
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in leaves(v)]
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in leaves(v)]
    return [value]


def stack(elements: Sequence[Any]) -> Any:
    """Stack a list of same-structured elements along a new first dimension."""
    first = elements[0]
    if isinstance(first, dict):
        return {k: stack([e[k] for e in elements]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(stack([e[i] for e in elements]) for i in range(len(first)))
    if isinstance(first, torch.Tensor):
        return torch.stack(list(elements))
    if isinstance(first, np.ndarray) or isinstance(first, (str, bytes)):
        return np.stack(elements) if isinstance(first, np.ndarray) else np.asarray(elements)
    return torch.as_tensor(np.asarray(elements))


def concat(parts: Sequence[Any]) -> Any:
    """Concatenate same-structured elements along their first dimension."""
    first = parts[0]
    if isinstance(first, dict):
        return {k: concat([p[k] for p in parts]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(concat([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, torch.Tensor):
        return torch.cat(list(parts))
    return np.concatenate(parts)


def batch_size_of(value: Any) -> int:
    """The length of the first dimension of the first leaf."""
    return len(leaves(value)[0])


def slice_rows(value: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every leaf."""
    return map_structure(lambda leaf: leaf[start:stop], value)


def gather_rows(value: Any, indices: np.ndarray) -> Any:
    """Rows ``indices`` of every leaf (fancy indexing)."""
    index = torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64))
    # index_select, not ``leaf[index]``: advanced indexing costs about 4x more on CPU (87 vs 21 us
    # for 32 rows of 784 floats), a cost paid at every step.
    return map_structure(lambda leaf: torch.index_select(leaf, 0, index) if isinstance(leaf, torch.Tensor)
                         else leaf[indices], value)


def unpack_batch(data: Any) -> tuple[Any, Any, Any]:
    """Keras's rule: a tuple batch is ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``."""
    if isinstance(data, (tuple, list)) and not isinstance(data, torch.Tensor):
        if len(data) == 1:
            return data[0], None, None
        if len(data) == 2:
            return data[0], data[1], None
        if len(data) == 3:
            return data[0], data[1], data[2]
        raise ValueError(f"A batch must be x, (x,), (x, y) or (x, y, sample_weight); received a tuple of "
                         f"{len(data)} elements.")
    return data, None, None
