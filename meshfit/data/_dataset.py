"""`Dataset`: a deterministic, random-access input pipeline with an exact, saveable position.

Every node can compute its element ``i`` of pass ``t`` directly (``_get(i, t)``). The order of
examples is therefore a pure function of (seeds, pass), and an iterator's whole state is two
integers: which pass over the data it is in and how many elements of that pass it has produced.
Restoring that position continues at the very next example, prefetch or not. Replicas never change
the global order: a distributed dataset only decides which rows of each global batch a replica reads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from meshfit.data._node import AUTOTUNE, Node
from meshfit.data._options import Options
from meshfit.data._prefetch import Prefetcher
from meshfit.data._sources import Files, FromTensors, Range, TensorSlices, Zip
from meshfit.data._structure import map_structure, rebuild
from meshfit.data._transforms import Batch, Cache, Map, Prefetch, Repeat, Shard, Shuffle, Skip, Take

INFINITE = -1


class Dataset:
    """A pipeline of examples, built like ``tf.data.Dataset``.

    Example:
        >>> ds = Dataset.range(6).shuffle(6, seed=0).batch(3)
        >>> [b.tolist() for b in ds]
        [[3, 2, 5], [4, 0, 1]]
    """

    def __init__(self, node: Node) -> None:
        if not isinstance(node, Node):
            raise TypeError("Build datasets with Dataset.from_tensor_slices, range, from_files or list_files, "
                            f"not Dataset(...); received {type(node).__name__}.")
        self._node = node
        self._next_pass = 0

    # ---- sources -------------------------------------------------------------------------
    @staticmethod
    def from_tensor_slices(tensors: Any, name: str | None = None) -> Dataset:
        """Examples are the slices of ``tensors`` along their first dimension, by ``tf.data``'s rules.

        Tuples, namedtuples and dicts are structure; a Python list is one tensor (its rows are the
        examples); numpy arrays and tensors keep their dtype; Python floats become float32 and ints
        int64. ``name`` is accepted for TensorFlow code and unused.

        Example:
            >>> [e.tolist() for e in Dataset.from_tensor_slices([[1, 2], [3, 4]])]
            [[1, 2], [3, 4]]
        """
        return Dataset(TensorSlices(tensors))

    @staticmethod
    def from_tensors(tensors: Any, name: str | None = None) -> Dataset:
        """One element: ``tensors`` whole (converted as in `from_tensor_slices`)."""
        return Dataset(FromTensors(tensors))

    @staticmethod
    def zip(*datasets: Any, name: str | None = None) -> Dataset:
        """Element ``i`` is the tuple (or dict) of the datasets' elements ``i``; as long as the shortest.

        Accepts ``zip(a, b)`` or ``zip((a, b))`` or ``zip({"x": a, "y": b})``, as ``tf.data`` does.
        """
        structure = datasets[0] if len(datasets) == 1 and not isinstance(datasets[0], Dataset) else datasets
        return Dataset(Zip(_to_nodes(structure)))

    @staticmethod
    def range(*args: int, name: str | None = None) -> Dataset:
        """Integers as in Python's ``range`` (int64 tensors)."""
        return Dataset(Range(*args))

    @staticmethod
    def from_files(paths: Any, reader: Callable[[str], Any] | None = None) -> Dataset:
        """Examples read from files (``.npy``/``.npz`` by default); sharded by file under ``FILE``."""
        return Dataset(Files(paths, reader))

    @staticmethod
    def list_files(pattern: str, reader: Callable[[str], Any] | None = None) -> Dataset:
        """``from_files`` over the sorted files matching a glob ``pattern``."""
        return Dataset(Files.from_pattern(pattern, reader))

    # ---- transformations -----------------------------------------------------------------
    def shuffle(self, buffer_size: int, seed: int | None = None,
                reshuffle_each_iteration: bool = True, name: str | None = None) -> Dataset:
        """Shuffle with a ``buffer_size`` buffer, as ``tf.data`` does, but reproducibly.

        The order is a function of ``seed`` and the pass. With ``seed=None`` the seed is drawn from
        torch's global generator (as ``torch.utils.data.RandomSampler`` draws its own), so after
        ``torch.manual_seed(s)`` a program gets the same orders again, and two shuffles in one
        program get different ones. A distributed dataset makes every replica use rank 0's seed;
        backups record it, so a resume continues the same order.
        """
        return Dataset(Shuffle(self._node, buffer_size, seed, reshuffle_each_iteration))

    def repeat(self, count: int | None = None, name: str | None = None) -> Dataset:
        """Repeat ``count`` times: none when 0, forever when ``None`` or negative. Each pass reshuffles."""
        return Dataset(Repeat(self._node, count))

    def batch(self, batch_size: int, drop_remainder: bool = False, num_parallel_calls: int | None = None,
              deterministic: bool | None = None, name: str | None = None) -> Dataset:
        """Stack consecutive examples into batches of ``batch_size`` (``None`` components stay ``None``).

        ``num_parallel_calls`` and ``deterministic`` are accepted as ``map`` accepts them: batches are
        computed on demand, always in order (put a ``prefetch`` after the batch to overlap them).
        """
        _check_parallel_calls(num_parallel_calls)
        return Dataset(Batch(self._node, batch_size, drop_remainder))

    def map(self, map_func: Callable[..., Any], num_parallel_calls: int | None = None,
            deterministic: bool | None = None, name: str | None = None) -> Dataset:
        """Apply ``map_func`` to each element, by ``tf.data``'s rules.

        A tuple element is unpacked into arguments; a namedtuple, dict or tensor is passed whole. A
        returned list becomes a tuple, Python numbers become tensors. An error raised for one element
        is raised by ``next()`` and the next call goes on with the next element; ``StopIteration``
        raised by ``map_func`` is an error (``RuntimeError``), never the end of the data. Elements
        are computed on demand, in order, whatever ``num_parallel_calls`` and ``deterministic`` say.
        """
        _check_parallel_calls(num_parallel_calls)
        return Dataset(Map(self._node, map_func))

    def cache(self, filename: str = "", name: str | None = None) -> Dataset:
        """Keep elements in memory after they are first computed (the first pass is replayed)."""
        if filename:
            raise ValueError(f"Invalid `filename`: only the in-memory cache is supported, received "
                             f"filename={filename!r}. Call cache() without a filename.")
        return Dataset(Cache(self._node))

    def prefetch(self, buffer_size: int | None = AUTOTUNE, name: str | None = None) -> Dataset:
        """Compute up to ``buffer_size`` elements ahead on a background thread (AUTOTUNE or None: 2;
        0: none)."""
        return Dataset(Prefetch(self._node, AUTOTUNE if buffer_size is None else buffer_size))

    def shard(self, num_shards: int, index: int, name: str | None = None) -> Dataset:
        """Keep every ``num_shards``-th element, starting at ``index``."""
        return Dataset(Shard(self._node, num_shards, index))

    def take(self, count: int, name: str | None = None) -> Dataset:
        """The first ``count`` elements (all when -1)."""
        return Dataset(Take(self._node, count))

    def skip(self, count: int, name: str | None = None) -> Dataset:
        """All but the first ``count`` elements."""
        return Dataset(Skip(self._node, count))

    def with_options(self, options: Options) -> Dataset:
        """The same dataset carrying ``options`` (see `Options`)."""
        if not isinstance(options, Options):
            raise TypeError(f"Invalid `options`: expected meshfit.data.Options, received {options!r}.")
        return Dataset(self._node.with_options(options))

    def options(self) -> Options:
        """The options set on this dataset or the nearest one it was built from."""
        return self._node.options()

    # ---- iterating ------------------------------------------------------------------------
    def cardinality(self) -> int:
        """The number of elements, or ``INFINITE`` (-1)."""
        n = self._length()
        return INFINITE if n is None else n

    def __len__(self) -> int:
        n = self._length()
        if n is None:
            raise TypeError("The dataset is infinite (it repeats forever), so it has no length.")
        return n

    def __iter__(self) -> DatasetIterator:
        # Like a new tf.data iterator, each one starts the next pass (reshuffled when shuffling).
        return DatasetIterator(self, pass_index=self.start_pass())

    def as_numpy_iterator(self) -> Iterator[Any]:
        """Iterate with numpy leaves (tensors become numpy arrays; the structure is kept), as in TF.

        Example:
            >>> list(Dataset.from_tensor_slices({"a": [1, 2]}).as_numpy_iterator())
            [{'a': array(1)}, {'a': array(2)}]
        """
        for element in self:
            yield map_structure(_to_numpy, element)

    # ---- the seam for meshfit's other packages (distribution, the training loop) --------------
    @property
    def node(self) -> Node:
        """The pipeline's top `Node` (the random-access protocol; see ``meshfit/data/_node.py``)."""
        return self._node

    def start_pass(self) -> int:
        """The pass a new iterator (or ``fit``) over this object starts at; later ones get the next."""
        start = self._next_pass
        self._next_pass = start + 1
        return start

    def end_pass(self, pass_index: int) -> None:
        """Passes up to ``pass_index`` were read (by ``fit``): the next iterator starts after it."""
        self._next_pass = max(self._next_pass, pass_index + 1)

    # ---- the random-access protocol, answered by the top node --------------------------------
    def _length(self) -> int | None:
        return self._node._length()

    def _get(self, index: int, pass_index: int) -> Any:
        return self._node._get(index, pass_index)

    def _gather(self, indices: np.ndarray, pass_index: int) -> Any:
        return self._node._gather(indices, pass_index)

    def _gather_range(self, start: int, stop: int, pass_index: int) -> Any:
        return self._node._gather_range(start, stop, pass_index)

    def _prefetch_size(self) -> int:
        return self._node._prefetch_size()

    def __repr__(self) -> str:
        return f"<Dataset {type(self._node).__name__} cardinality={self.cardinality()}>"


def _to_numpy(leaf: Any) -> Any:
    return leaf.numpy(force=True) if isinstance(leaf, torch.Tensor) else leaf


def _to_nodes(structure: Any) -> Any:
    if isinstance(structure, Dataset):
        return structure.node
    if isinstance(structure, dict):
        return {k: _to_nodes(v) for k, v in structure.items()}
    if isinstance(structure, tuple):
        return rebuild(structure, [_to_nodes(v) for v in structure])
    raise TypeError(f"Invalid `datasets`: expected Datasets in a tuple or dict, received {structure!r}.")


def _check_parallel_calls(value: Any) -> None:
    if value is None or value == AUTOTUNE:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"Invalid `num_parallel_calls`: expected a positive int, AUTOTUNE or None, "
                         f"received num_parallel_calls={value!r}.")


class DatasetIterator:
    """Iterates a `Dataset`; ``state_dict()`` is its exact position, ``load_state_dict`` moves it there."""

    def __init__(self, dataset: Dataset, pass_index: int = 0, index: int = 0) -> None:
        self._prefetcher: Prefetcher | None = None  # first: ``__del__`` runs even if the rest raises
        self._lock = threading.Lock()  # next() from several threads, as a tf.data iterator allows
        self._dataset = dataset
        self._pass_index = pass_index
        self._index = index
        self._length = dataset._length()

    def _producer(self) -> Callable[[int], Any]:
        """``index -> element`` of the current pass, holding no reference to the iterator.

        ``StopIteration`` means the end of the pass and nothing else: one raised while computing an
        element (by a reader, a torch ``Dataset``) is an error, as in TF, never a silent early end.

        The prefetch thread keeps its producer alive; if that were a bound method, the thread would
        keep the iterator alive too, ``__del__`` would never stop the thread, and an abandoned
        iterator over an infinite dataset would leak a thread for the life of the process.
        """
        dataset, pass_index, length = self._dataset, self._pass_index, self._length

        def produce(index: int) -> Any:
            if length is not None and index >= length:
                raise StopIteration
            try:
                return dataset._get(index, pass_index)
            except StopIteration as error:
                raise RuntimeError(f"Computing element {index} raised StopIteration; only the dataset's length "
                                   "ends it.") from error

        return produce

    def __iter__(self) -> DatasetIterator:
        return self

    def __next__(self) -> Any:
        with self._lock:
            return self._next()

    def _next(self) -> Any:
        size = self._dataset._prefetch_size()
        try:
            if size:
                if self._prefetcher is None:
                    self._prefetcher = Prefetcher(self._producer(), self._index, size)
                element = self._prefetcher.get()
            else:
                element = self._producer()(self._index)
        except StopIteration:
            raise
        except Exception:
            # As in tf.data: the element that failed is consumed; the next call goes on after it, so a
            # loop that catches and skips bad records ends.
            self._index += 1
            raise
        self._index += 1
        return element

    def state_dict(self) -> dict[str, int]:
        """The position: ``{"pass": pass number, "index": elements produced in this pass}``."""
        return {"pass": self._pass_index, "index": self._index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Move to a position taken by ``state_dict``."""
        self.close()
        self._pass_index, self._index = int(state["pass"]), int(state["index"])

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def __del__(self) -> None:
        self.close()
