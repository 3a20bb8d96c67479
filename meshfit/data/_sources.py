"""Where examples come from: tensors in memory, a range, files, or a map-style torch ``Dataset``."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from meshfit.data._node import Node
from meshfit.data._structure import (
    concat,
    copy_rows,
    from_python,
    gather_rows,
    leaves,
    map_structure,
    rebuild,
    to_tensor,
)


def _shape(leaf: Any) -> tuple[int, ...]:
    if isinstance(leaf, (torch.Tensor, np.ndarray)):
        return tuple(leaf.shape)
    return ()  # a Python object (a string, a number) is one value: it has no rows to slice


class TensorSlices(Node):
    def __init__(self, tensors: Any) -> None:
        self.tensors = from_python(tensors)
        parts = leaves(self.tensors)
        if not parts or any(len(_shape(leaf)) == 0 for leaf in parts):
            raise ValueError(f"Invalid `tensors`: slicing needs components of at least one dimension, received "
                             f"shapes {[_shape(leaf) for leaf in parts]}. Use Dataset.from_tensors for one element.")
        lengths = {_shape(leaf)[0] for leaf in parts}
        if len(lengths) != 1:
            raise ValueError(f"Invalid `tensors`: all components must have the same first dimension, "
                             f"received shapes {[_shape(leaf) for leaf in parts]}.")
        self._n = lengths.pop()

    def _length(self) -> int:
        return self._n

    def _get(self, index: int, pass_index: int) -> Any:
        if not 0 <= index < self._n:
            raise IndexError(index)
        return map_structure(lambda leaf: leaf[index], self.tensors)

    def _gather(self, indices: np.ndarray, pass_index: int) -> Any:
        return gather_rows(self.tensors, indices)

    def _gather_range(self, start: int, stop: int, pass_index: int) -> Any:
        if not 0 <= start <= stop <= self._n:
            raise IndexError(start if start < 0 or start > self._n else stop - 1)
        return copy_rows(self.tensors, start, stop)


class FromTensors(Node):
    """One element: the whole structure (``tf.data``'s conversion rules)."""

    def __init__(self, tensors: Any) -> None:
        self.tensors = from_python(tensors)

    def _length(self) -> int:
        return 1

    def _get(self, index: int, pass_index: int) -> Any:
        if index != 0:
            raise IndexError(index)
        return self.tensors


class Zip(Node):
    """Element ``i`` is the structure (tuple or dict) of the datasets' elements ``i``."""

    def __init__(self, nodes: Any) -> None:
        self.structure = nodes
        self.children: list[Node] = _node_leaves(nodes)
        if not self.children:
            raise ValueError("Invalid `datasets`: expected a tuple or dict of at least one Dataset, received none.")

    def _length(self) -> int | None:
        lengths = [n for n in (child._length() for child in self.children) if n is not None]
        return min(lengths) if lengths else None

    def _get(self, index: int, pass_index: int) -> Any:
        return _node_map(lambda node: node._get(index, pass_index), self.structure)

    def _gather(self, indices: np.ndarray, pass_index: int) -> Any:
        return _node_map(lambda node: node._gather(indices, pass_index), self.structure)

    def _prefetch_size(self) -> int:
        return max(child._prefetch_size() for child in self.children)

    def _nodes(self) -> list[Node]:
        # The zipped pipelines' nodes too: their shuffles are seeded, broadcast and saved like any other.
        return [self] + [node for child in self.children for node in child._nodes()]

    def _transform_chain(self, fn: Callable[[Node], Node | None]) -> Node:
        replaced = fn(self)
        if replaced is not None:
            return replaced
        raise ValueError("A pipeline batched (or read from files) inside Dataset.zip cannot be split per replica "
                         "by AutoShardPolicy.FILE or OFF. Batch after the zip (Dataset.zip((a, b)).batch(n)), or "
                         "use Options(auto_shard_policy=AutoShardPolicy.DATA).")


def _node_leaves(structure: Any) -> list[Node]:
    if isinstance(structure, Node):
        return [structure]
    if isinstance(structure, dict):
        return [n for v in structure.values() for n in _node_leaves(v)]
    if isinstance(structure, tuple):
        return [n for v in structure for n in _node_leaves(v)]
    raise TypeError(f"Invalid `datasets`: expected a tuple or dict of Datasets, received {structure!r}.")


def _node_map(fn: Any, structure: Any) -> Any:
    if isinstance(structure, Node):
        return fn(structure)
    if isinstance(structure, dict):
        return {k: _node_map(fn, v) for k, v in structure.items()}
    return rebuild(structure, [_node_map(fn, v) for v in structure])


class Range(Node):
    def __init__(self, *args: int) -> None:
        self._range = range(*args)

    def _length(self) -> int:
        return len(self._range)

    def _get(self, index: int, pass_index: int) -> torch.Tensor:
        if not 0 <= index < len(self._range):
            raise IndexError(index)
        return torch.tensor(self._range[index])

    def _gather(self, indices: np.ndarray, pass_index: int) -> torch.Tensor:
        start, step = self._range.start, self._range.step
        return torch.from_numpy(start + indices * step)


def _read_numpy(path: str) -> Any:
    """Default reader: a ``.npy`` array, or a ``.npz``'s arrays (``x``, ``y`` first, then by name)."""
    with np.load(path, allow_pickle=False) as data:
        if isinstance(data, np.ndarray):
            return data
        names = sorted(data.files, key=lambda k: ({"x": 0, "y": 1}.get(k, 2), k))
        arrays = tuple(data[k] for k in names)
    return arrays[0] if len(arrays) == 1 else arrays


class Files(Node):
    """Examples from a list of files, in file order; `AutoShardPolicy.FILE` shards the file list."""

    def __init__(self, paths: Any, reader: Callable[[str], Any] | None = None) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.paths = [os.fspath(p) for p in paths]
        if not self.paths:
            raise ValueError("Invalid `paths`: expected at least one file, received an empty list.")
        self.reader = reader or _read_numpy
        self._loaded: TensorSlices | None = None

    @classmethod
    def from_pattern(cls, pattern: str, reader: Callable[[str], Any] | None = None) -> Files:
        paths = sorted(glob.glob(pattern))
        if not paths:
            raise FileNotFoundError(f"Invalid `pattern`: no file matches pattern={pattern!r}.")
        return cls(paths, reader)

    def shard_files(self, num_shards: int, index: int) -> Files:
        """The files ``index, index + num_shards, ...``: what replica ``index`` reads under FILE."""
        if len(self.paths) < num_shards:
            raise ValueError(f"AutoShardPolicy.FILE needs at least one file per input pipeline: "
                             f"{len(self.paths)} files for {num_shards} pipelines. Use more files, or "
                             f"Options(auto_shard_policy=AutoShardPolicy.DATA).")
        return Files(self.paths[index::num_shards], self.reader)

    def _table(self) -> TensorSlices:
        if self._loaded is None:
            # A reader may return an array, or a tuple or dict of arrays: join the files leaf by leaf.
            self._loaded = TensorSlices(concat([to_tensor(self.reader(p)) for p in self.paths]))
        return self._loaded

    def _length(self) -> int:
        return self._table()._length()

    def _get(self, index: int, pass_index: int) -> Any:
        return self._table()._get(index, pass_index)

    def _gather(self, indices: np.ndarray, pass_index: int) -> Any:
        return self._table()._gather(indices, pass_index)


class TorchMapDataset(Node):
    """A map-style ``torch.utils.data.Dataset`` (``__len__`` + ``__getitem__``) as a source."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def _length(self) -> int:
        return len(self.dataset)

    def _get(self, index: int, pass_index: int) -> Any:
        return to_tensor(self.dataset[index])
