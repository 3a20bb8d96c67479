"""Where examples come from: tensors in memory, a range, files, or a map-style torch ``Dataset``."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from meshfit.data._node import Node
from meshfit.data._structure import concat, gather_rows, leaves, map_structure, stack, to_tensor


class TensorSlices(Node):
    def __init__(self, tensors: Any) -> None:
        self.tensors = to_tensor(tensors)
        lengths = {len(leaf) for leaf in leaves(self.tensors)}
        if len(lengths) != 1:
            shapes = [tuple(getattr(leaf, "shape", (len(leaf),))) for leaf in leaves(self.tensors)]
            raise ValueError(f"Invalid `tensors`: all components must have the same first dimension, "
                             f"received shapes {shapes}.")
        self._n = lengths.pop()

    def _length(self) -> int:
        return self._n

    def _get(self, index: int, pass_index: int) -> Any:
        if not 0 <= index < self._n:
            raise IndexError(index)
        return map_structure(lambda leaf: leaf[index], self.tensors)

    def _gather(self, indices: np.ndarray, pass_index: int) -> Any:
        return gather_rows(self.tensors, indices)


class Range(Node):
    def __init__(self, *args: int) -> None:
        self._range = range(*args)

    def _length(self) -> int:
        return len(self._range)

    def _get(self, index: int, pass_index: int) -> torch.Tensor:
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

    def _gather(self, indices: np.ndarray, pass_index: int) -> Any:
        return stack([self._get(int(i), pass_index) for i in indices])
