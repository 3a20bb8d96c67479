"""Nested structures of tensors (tuples, namedtuples, lists, dicts): convert, map, stack and slice them.

Two conversions: `to_tensor` for what PyTorch code hands over (a ``DataLoader``'s ``[x, y]`` list is
structure) and `from_python` for ``tf.data``'s rules (`Dataset.from_tensor_slices`, ``from_tensors``
and ``map`` outputs): tuples, namedtuples and dicts are structure, a Python list is a tensor, Python
floats are float32. ``None`` is an empty component: it is kept, sliced and batched as ``None``.
"""

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
        return _from_array(value)
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


def from_python(value: Any) -> Any:
    """Convert a structure by ``tf.data``'s rules (see the module docstring).

    Tensors are kept; numpy arrays become tensors without a copy (string arrays stay numpy); a
    Python list (of numbers, or of same-shaped tensors or arrays) becomes one tensor: floats
    float32, ints int64 (torch's default, where TF's is int32), bools bool. Strings and other
    Python objects are kept as they are.
    """
    if value is None or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return _from_array(value)
    if isinstance(value, np.generic):
        return _from_array(np.asarray(value))
    if isinstance(value, dict):
        return {k: from_python(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return rebuild(value, [from_python(v) for v in value])
    if isinstance(value, list):
        return _list_to_tensor(value)
    if isinstance(value, bool):
        return torch.tensor(value)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float32)
    return value


def _from_array(array: np.ndarray) -> Any:
    if array.dtype.kind in "USO":
        return array
    # not np.ascontiguousarray: it turns a 0-d array into shape (1,)
    return torch.from_numpy(array if array.flags.c_contiguous else np.ascontiguousarray(array))


def _has_arrays(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return True
    return isinstance(value, (list, tuple)) and any(_has_arrays(v) for v in value)


def _list_to_tensor(value: list) -> Any:
    """A Python list as one tensor, as ``tf.convert_to_tensor`` makes it."""
    if not value:
        return torch.zeros(0, dtype=torch.float32)
    if _has_arrays(value):  # a list of tensors or arrays: stack them
        items = [v if isinstance(v, torch.Tensor) else from_python(list(v) if isinstance(v, tuple) else v)
                 for v in value]
        if not all(isinstance(item, torch.Tensor) for item in items):
            raise ValueError(f"Invalid list: a list is one tensor, so its items must be tensors, arrays or "
                             f"numbers of one shape; received items of types {[type(v).__name__ for v in value]}."
                             " Use a tuple to pass separate components.")
        shapes = [tuple(item.shape) for item in items]
        if len(set(shapes)) > 1:
            raise ValueError(f"Invalid list: a list is one tensor, so its items must have one shape; received "
                             f"shapes {shapes}. Use a tuple to pass components of different shapes.")
        return torch.stack(items)
    try:
        array = np.asarray(value)
    except ValueError:  # numpy refuses a ragged list
        array = np.empty(0, dtype=object)
    if array.dtype == object:
        raise ValueError(f"Invalid list: a list is one tensor, so it must be rectangular and of one type; "
                         f"received {_short(value)}. Use a tuple to pass components of different shapes.")
    if array.dtype == np.float64:  # Python floats: float32, as in TF and torch.tensor
        array = array.astype(np.float32)
    return _from_array(array)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_namedtuple(value: Any) -> bool:
    """Whether ``value`` is a namedtuple (an element passed whole to ``map``, not unpacked)."""
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def rebuild(like: Any, items: Sequence[Any]) -> Any:
    """A tuple, namedtuple or list of the same type as ``like`` holding ``items``."""
    if is_namedtuple(like):
        return type(like)(*items)
    return type(like)(items)


def map_structure(fn: Callable[[Any], Any], value: Any) -> Any:
    """Apply ``fn`` to every leaf (``None`` components stay ``None``)."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {k: map_structure(fn, v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return rebuild(value, [map_structure(fn, v) for v in value])
    return fn(value)


def leaves(value: Any) -> list[Any]:
    """The leaves of a structure, depth first (``None`` components hold none)."""
    if value is None:
        return []
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in leaves(v)]
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in leaves(v)]
    return [value]


def stack(elements: Sequence[Any], _path: str = "") -> Any:
    """Stack a list of same-structured elements along a new first dimension."""
    first = elements[0]
    if first is None:
        if any(e is not None for e in elements):
            raise ValueError(f"Cannot batch component {_path or 0}: the first element is None and another is not.")
        return None
    if isinstance(first, dict):
        return {k: stack([e[k] for e in elements], f"{_path}[{k!r}]") for k in first}
    if isinstance(first, (tuple, list)):
        return rebuild(first, [stack([e[i] for e in elements], f"{_path}[{i}]") for i in range(len(first))])
    if isinstance(first, torch.Tensor):
        for k, e in enumerate(elements):
            if isinstance(e, torch.Tensor) and e.shape != first.shape:
                raise ValueError(f"Cannot batch tensors with different shapes in component {_path or 0}. First "
                                 f"element had shape {list(first.shape)} and element {k} had shape "
                                 f"{list(e.shape)}. Make the shapes equal in a map (pad or crop), or batch 1.")
        return torch.stack(list(elements))
    if isinstance(first, np.ndarray) or isinstance(first, (str, bytes)):
        return np.stack(elements) if isinstance(first, np.ndarray) else np.asarray(elements)
    array = np.asarray(elements)
    if array.dtype == object:
        raise TypeError(f"Cannot batch component {_path or 0}: its elements are {type(first).__name__} objects, not "
                        "tensors, arrays, numbers or strings. Convert them to tensors in a map before batching.")
    return from_python(array)


def concat(parts: Sequence[Any]) -> Any:
    """Concatenate same-structured elements along their first dimension."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, dict):
        return {k: concat([p[k] for p in parts]) for k in first}
    if isinstance(first, (tuple, list)):
        return rebuild(first, [concat([p[i] for p in parts]) for i in range(len(first))])
    if isinstance(first, torch.Tensor):
        return torch.cat(list(parts))
    return np.concatenate(parts)


def batch_size_of(value: Any) -> int:
    """The length of the first dimension of the first leaf."""
    if type(value) is torch.Tensor:
        leaf = value
    elif type(value) is tuple and value and type(value[0]) is torch.Tensor:
        leaf = value[0]  # an ``(x, y)`` batch: its first leaf without the walk
    else:
        leaf = _first_leaf(value)
    if leaf is _NO_LEAF:
        raise IndexError("batch_size_of: the structure holds no leaf (only None components)")
    if type(leaf) is torch.Tensor and leaf.ndim:
        return leaf.shape[0]  # len(leaf), without Tensor.__len__'s Python frame (a step asks several times)
    return len(leaf)


_NO_LEAF = object()


def _first_leaf(value: Any) -> Any:
    """``leaves(value)[0]`` without building the list; `_NO_LEAF` when there is none."""
    if type(value) is torch.Tensor:
        return value
    if value is None:
        return _NO_LEAF
    if isinstance(value, dict):
        children: Any = value.values()
    elif isinstance(value, (tuple, list)):
        children = value
    else:
        return value
    for child in children:
        leaf = _first_leaf(child)
        if leaf is not _NO_LEAF:
            return leaf
    return _NO_LEAF


def slice_rows(value: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every leaf."""
    return map_structure(lambda leaf: leaf[start:stop], value)


def gather_rows(value: Any, indices: np.ndarray) -> Any:
    """Rows ``indices`` of every leaf (fancy indexing)."""
    if indices.dtype != np.int64 or not indices.flags.c_contiguous:  # (a permutation's slice is both)
        indices = np.ascontiguousarray(indices, dtype=np.int64)
    index = torch.from_numpy(indices)
    # index_select, not ``leaf[index]``: advanced indexing costs about 4x more on CPU (87 vs 21 us
    # for 32 rows of 784 floats), a cost paid at every step.
    if type(value) is tuple:  # the usual ``(x, y)`` rows of a step: no structure walk, no closure per leaf
        return tuple([torch.index_select(leaf, 0, index) if type(leaf) is torch.Tensor
                      else gather_rows(leaf, indices) for leaf in value])
    return map_structure(lambda leaf: torch.index_select(leaf, 0, index) if isinstance(leaf, torch.Tensor)
                         else leaf[indices], value)


def copy_rows(value: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every leaf, copied: `gather_rows` of consecutive rows, in one
    ``narrow_copy`` kernel a tensor (no index tensor to build and read)."""
    if type(value) is tuple:  # the usual ``(x, y)`` rows of a step: no structure walk, no closure per leaf
        length = stop - start
        return tuple([torch.narrow_copy(leaf, 0, start, length) if type(leaf) is torch.Tensor
                      else copy_rows(leaf, start, stop) for leaf in value])
    return map_structure(lambda leaf: torch.narrow_copy(leaf, 0, start, stop - start) if isinstance(leaf, torch.Tensor)
                         else leaf[np.arange(start, stop, dtype=np.int64)], value)


def unpack_batch(data: Any) -> tuple[Any, Any, Any]:
    """Keras's rule: a tuple batch is ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``."""
    if data.__class__ is tuple and len(data) == 2:  # the usual batch: no type checks
        return data[0], data[1], None
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
