"""`Dataset`: a deterministic, random-access input pipeline with an exact, saveable position.

Every node can compute its element ``i`` of iteration ``t`` directly (``_get(i, t)``). The order of
examples is therefore a pure function of (seeds, iteration), and an iterator's whole state is two
integers: which pass over the data it is in and how many elements of that pass it has produced.
Restoring that position continues at the very next example, prefetch or not. Replicas never change
the global order: a distributed dataset only decides which rows of each global batch a replica reads.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from meshfit.data._options import Options
from meshfit.data._prefetch import Prefetcher
from meshfit.data._structure import stack

INFINITE = -1
AUTOTUNE = -1


class Dataset:
    """A pipeline of examples, built like ``tf.data.Dataset``.

    Example:
        >>> ds = Dataset.range(6).shuffle(6, seed=0).batch(3)
        >>> [b.tolist() for b in ds]
        [[3, 2, 5], [4, 0, 1]]
    """

    _inner: Dataset | None = None
    _options: Options | None = None

    # ---- sources -------------------------------------------------------------------------
    @staticmethod
    def from_tensor_slices(tensors: Any) -> Dataset:
        """Examples are the slices of ``tensors`` (arrays, tensors, tuples or dicts of them) along dim 0."""
        from meshfit.data._sources import TensorSlices

        return TensorSlices(tensors)

    @staticmethod
    def range(*args: int) -> Dataset:
        """Integers as in Python's ``range``."""
        from meshfit.data._sources import Range

        return Range(*args)

    @staticmethod
    def from_files(paths: Any, reader: Callable[[str], Any] | None = None) -> Dataset:
        """Examples read from files (``.npy``/``.npz`` by default); sharded by file under ``FILE``."""
        from meshfit.data._sources import Files

        return Files(paths, reader)

    @staticmethod
    def list_files(pattern: str, reader: Callable[[str], Any] | None = None) -> Dataset:
        """``from_files`` over the sorted files matching a glob ``pattern``."""
        from meshfit.data._sources import Files

        return Files.from_pattern(pattern, reader)

    # ---- transformations -----------------------------------------------------------------
    def shuffle(self, buffer_size: int, seed: int | None = None,
                reshuffle_each_iteration: bool = True) -> Dataset:
        """Shuffle with a ``buffer_size`` buffer, as ``tf.data`` does, but reproducibly.

        The order is a function of ``seed`` and the iteration. With ``seed=None`` the seed derives
        from ``torch.initial_seed()`` (so ``torch.manual_seed`` makes it reproducible) without
        drawing from torch's generator; distributed datasets make every replica use rank 0's seed.
        """
        return Shuffle(self, buffer_size, seed, reshuffle_each_iteration)

    def repeat(self, count: int | None = None) -> Dataset:
        """Repeat ``count`` times, forever when ``None`` or -1. Each pass reshuffles."""
        return Repeat(self, count)

    def batch(self, batch_size: int, drop_remainder: bool = False) -> Dataset:
        """Stack consecutive examples into batches of ``batch_size``."""
        return Batch(self, batch_size, drop_remainder)

    def map(self, map_func: Callable[..., Any], num_parallel_calls: int | None = None,
            deterministic: bool | None = None) -> Dataset:
        """Apply ``map_func`` to each element (a tuple element is unpacked into arguments)."""
        del num_parallel_calls, deterministic  # elements are computed on demand, in order
        return Map(self, map_func)

    def cache(self, filename: str = "") -> Dataset:
        """Keep elements in memory after they are first computed (the first pass is replayed)."""
        if filename:
            raise ValueError(f"Invalid `filename`: only the in-memory cache is supported, received "
                             f"filename={filename!r}. Call cache() without a filename.")
        return Cache(self)

    def prefetch(self, buffer_size: int = AUTOTUNE) -> Dataset:
        """Compute up to ``buffer_size`` elements ahead on a background thread (AUTOTUNE: 2)."""
        return Prefetch(self, buffer_size)

    def shard(self, num_shards: int, index: int) -> Dataset:
        """Keep every ``num_shards``-th element, starting at ``index``."""
        return Shard(self, num_shards, index)

    def take(self, count: int) -> Dataset:
        """The first ``count`` elements (all when -1)."""
        return Take(self, count)

    def skip(self, count: int) -> Dataset:
        """All but the first ``count`` elements."""
        return Skip(self, count)

    def with_options(self, options: Options) -> Dataset:
        """The same dataset carrying ``options`` (see `Options`)."""
        if not isinstance(options, Options):
            raise TypeError(f"Invalid `options`: expected meshfit.data.Options, received {options!r}.")
        clone = copy.copy(self)
        clone._options = options
        return clone

    def options(self) -> Options:
        """The options set on this dataset or the nearest one it was built from."""
        node: Dataset | None = self
        while node is not None:
            if node._options is not None:
                return node._options
            node = node._inner
        return Options()

    # ---- iteration -----------------------------------------------------------------------
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
        return DatasetIterator(self)

    def as_numpy_iterator(self) -> Iterator[Any]:
        """Iterate with numpy leaves."""
        from meshfit.data._structure import map_structure

        for element in self:
            yield map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, element)

    # ---- the random-access protocol every node implements -----------------------------------
    def _length(self) -> int | None:
        """Number of elements per iteration; ``None`` when infinite."""
        raise NotImplementedError

    def _get(self, index: int, iteration: int) -> Any:
        """Element ``index`` of pass ``iteration``."""
        raise NotImplementedError

    def _gather(self, indices: np.ndarray, iteration: int) -> Any:
        """Elements ``indices`` of pass ``iteration``, stacked."""
        return stack([self._get(int(i), iteration) for i in indices])

    def _prefetch_size(self) -> int:
        return 0 if self._inner is None else self._inner._prefetch_size()

    def _replace_inner(self, inner: Dataset) -> Dataset:
        clone = copy.copy(self)
        clone._inner = inner
        return clone

    def _transform_chain(self, fn: Callable[[Dataset], Dataset | None]) -> Dataset:
        """Rebuild the chain, replacing the first node (from the top) for which ``fn`` returns one."""
        replaced = fn(self)
        if replaced is not None:
            return replaced
        if self._inner is None:
            raise LookupError("no node matched")
        return self._replace_inner(self._inner._transform_chain(fn))

    def _nodes(self) -> list[Dataset]:
        nodes, node = [], self
        while node is not None:
            nodes.append(node)
            node = node._inner
        return nodes

    def __repr__(self) -> str:
        return f"<{type(self).__name__} cardinality={self.cardinality()}>"


class DatasetIterator:
    """Iterates a `Dataset`; ``state_dict()`` is its exact position, ``load_state_dict`` moves it there."""

    def __init__(self, dataset: Dataset, iteration: int = 0, index: int = 0) -> None:
        self._prefetcher: Prefetcher | None = None  # first: ``__del__`` runs even if the rest raises
        self._dataset = dataset
        self._iteration = iteration
        self._index = index
        self._length = dataset._length()

    def _producer(self) -> Callable[[int], Any]:
        """``index -> element`` of the current pass, holding no reference to the iterator.

        The prefetch thread keeps its producer alive; if that were a bound method, the thread would
        keep the iterator alive too, ``__del__`` would never stop the thread, and an abandoned
        iterator over an infinite dataset would leak a thread for the life of the process.
        """
        dataset, iteration, length = self._dataset, self._iteration, self._length

        def produce(index: int) -> Any:
            if length is not None and index >= length:
                raise StopIteration
            return dataset._get(index, iteration)

        return produce

    def __iter__(self) -> DatasetIterator:
        return self

    def __next__(self) -> Any:
        size = self._dataset._prefetch_size()
        if size:
            if self._prefetcher is None:
                self._prefetcher = Prefetcher(self._producer(), self._index, size)
            element = self._prefetcher.get()
        else:
            element = self._producer()(self._index)
        self._index += 1
        return element

    def state_dict(self) -> dict[str, int]:
        """The position: ``{"iteration": pass number, "index": elements produced in this pass}``."""
        return {"iteration": self._iteration, "index": self._index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Move to a position taken by ``state_dict``."""
        self.close()
        self._iteration, self._index = int(state["iteration"]), int(state["index"])

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def __del__(self) -> None:
        self.close()


def _check_positive_int(name: str, value: Any, allow: tuple = ()) -> None:
    if value in allow:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"Invalid `{name}`: expected a positive int, received {name}={value!r}.")


class Shuffle(Dataset):
    """Emulates ``tf.data``'s buffer shuffle with a generator seeded by (seed, iteration)."""

    def __init__(self, inner: Dataset, buffer_size: int, seed: int | None, reshuffle: bool) -> None:
        _check_positive_int("buffer_size", buffer_size)
        if seed is None:
            seed = _unseeded_shuffle_seed()
        self._inner, self.buffer_size, self.seed, self.reshuffle = inner, int(buffer_size), int(seed), reshuffle
        self._cache: tuple[int, np.ndarray] | None = None

    def _length(self) -> int | None:
        return self._inner._length()

    def _replace_inner(self, inner: Dataset) -> Dataset:
        clone = super()._replace_inner(inner)
        clone._cache = None  # the permutation was drawn for the old input's length
        return clone

    def _permutation(self, iteration: int) -> np.ndarray:
        it = iteration if self.reshuffle else 0
        cached = self._cache  # read once: a prefetch thread may replace it concurrently
        if cached is None or cached[0] != it:
            n = self._length()
            rng = np.random.default_rng([self.seed, it])
            cached = (it, _buffer_permutation(n, self.buffer_size, rng))
            self._cache = cached
        return cached[1]

    def _source_index(self, index: int, iteration: int) -> int:
        if self._length() is None:  # infinite input: shuffle within consecutive windows
            window, offset = divmod(index, self.buffer_size)
            it = iteration if self.reshuffle else 0
            perm = np.random.default_rng([self.seed, it, window]).permutation(self.buffer_size)
            return window * self.buffer_size + int(perm[offset])
        return int(self._permutation(iteration)[index])

    def _get(self, index: int, iteration: int) -> Any:
        return self._inner._get(self._source_index(index, iteration), iteration)

    def _gather(self, indices: np.ndarray, iteration: int) -> Any:
        if self._length() is None:
            source = np.array([self._source_index(int(i), iteration) for i in indices], dtype=np.int64)
        else:
            source = self._permutation(iteration)[indices]
        return self._inner._gather(source, iteration)


_UNSEEDED = [0]


def _unseeded_shuffle_seed() -> int:
    """A seed for ``shuffle(seed=None)``: from torch's initial seed and a per-process counter."""
    import torch

    _UNSEEDED[0] += 1
    return int(np.random.SeedSequence([torch.initial_seed() % 2**63, _UNSEEDED[0]]).generate_state(1)[0])


def _buffer_permutation(n: int, buffer_size: int, rng: np.random.Generator) -> np.ndarray:
    """The order a ``buffer_size`` shuffle buffer emits ``0..n-1`` in, for random draws from ``rng``."""
    if buffer_size >= n:
        return rng.permutation(n)
    draws = rng.random(n)
    buffer = list(range(buffer_size))
    out = np.empty(n, dtype=np.int64)
    upcoming = buffer_size
    for k in range(n):
        slot = int(draws[k] * len(buffer))
        out[k] = buffer[slot]
        if upcoming < n:
            buffer[slot] = upcoming
            upcoming += 1
        else:
            buffer[slot] = buffer[-1]
            buffer.pop()
    return out


class Repeat(Dataset):
    def __init__(self, inner: Dataset, count: int | None) -> None:
        if count is not None and count != -1:
            _check_positive_int("count", count)
        self._inner, self.count = inner, None if count in (None, -1) else int(count)

    def _length(self) -> int | None:
        n = self._inner._length()
        if n is None or self.count is None:
            return None
        return n * self.count

    def _locate(self, index: int, iteration: int) -> tuple[int, int]:
        n = self._inner._length()
        if n is None:
            return index, iteration
        if n == 0:
            raise StopIteration
        # Pass ``iteration`` of a finite repeat covers inner passes ``[iteration*count, ...)``; passes
        # of an infinite one are kept apart by a large stride.
        passes = iteration * (2**32 if self.count is None else self.count)
        return index % n, passes + index // n

    def _get(self, index: int, iteration: int) -> Any:
        return self._inner._get(*self._locate(index, iteration))

    def _gather(self, indices: np.ndarray, iteration: int) -> Any:
        located = [self._locate(int(i), iteration) for i in indices]
        if len({t for _, t in located}) == 1:
            return self._inner._gather(np.array([i for i, _ in located], dtype=np.int64), located[0][1])
        return stack([self._inner._get(i, t) for i, t in located])


class Batch(Dataset):
    def __init__(self, inner: Dataset, batch_size: int, drop_remainder: bool) -> None:
        _check_positive_int("batch_size", batch_size)
        self._inner, self.batch_size, self.drop_remainder = inner, int(batch_size), bool(drop_remainder)

    def _length(self) -> int | None:
        n = self._inner._length()
        if n is None:
            return None
        return n // self.batch_size if self.drop_remainder else -(-n // self.batch_size)

    def rows(self, index: int) -> tuple[int, int]:
        """The example range ``[start, stop)`` of batch ``index``."""
        start = index * self.batch_size
        n = self._inner._length()
        stop = start + self.batch_size if n is None else min(start + self.batch_size, n)
        return start, stop

    def _get(self, index: int, iteration: int) -> Any:
        length = self._length()
        if length is not None and index >= length:
            raise IndexError(index)
        start, stop = self.rows(index)
        return self._inner._gather(np.arange(start, stop, dtype=np.int64), iteration)

    def get_rows(self, index: int, iteration: int, start: int, stop: int) -> Any:
        """Rows ``[start, stop)`` (relative) of batch ``index``, computing only those."""
        first, last = self.rows(index)
        lo, hi = min(first + start, last), min(first + stop, last)
        return self._inner._gather(np.arange(lo, hi, dtype=np.int64), iteration)


class Map(Dataset):
    def __init__(self, inner: Dataset, fn: Callable[..., Any]) -> None:
        if not callable(fn):
            raise TypeError(f"Invalid `map_func`: expected a callable, received {fn!r}.")
        self._inner, self.fn = inner, fn

    def _length(self) -> int | None:
        return self._inner._length()

    def _get(self, index: int, iteration: int) -> Any:
        element = self._inner._get(index, iteration)
        return self.fn(*element) if isinstance(element, tuple) else self.fn(element)


class Cache(Dataset):
    def __init__(self, inner: Dataset) -> None:
        self._inner, self._store = inner, {}

    def _replace_inner(self, inner: Dataset) -> Dataset:
        clone = super()._replace_inner(inner)
        clone._store = {}  # the cached elements are the old input's, not the new one's
        return clone

    def _length(self) -> int | None:
        return self._inner._length()

    def _get(self, index: int, iteration: int) -> Any:
        if index not in self._store:
            self._store[index] = self._inner._get(index, 0)
        return self._store[index]


class Prefetch(Dataset):
    def __init__(self, inner: Dataset, buffer_size: int) -> None:
        _check_positive_int("buffer_size", buffer_size, allow=(AUTOTUNE,))
        self._inner, self.buffer_size = inner, 2 if buffer_size == AUTOTUNE else int(buffer_size)

    def _length(self) -> int | None:
        return self._inner._length()

    def _get(self, index: int, iteration: int) -> Any:
        return self._inner._get(index, iteration)

    def _gather(self, indices: np.ndarray, iteration: int) -> Any:
        return self._inner._gather(indices, iteration)

    def _prefetch_size(self) -> int:
        return max(self.buffer_size, self._inner._prefetch_size())


class Shard(Dataset):
    def __init__(self, inner: Dataset, num_shards: int, index: int) -> None:
        _check_positive_int("num_shards", num_shards)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_shards:
            raise ValueError(f"Invalid `index`: expected 0 <= index < num_shards={num_shards}, "
                             f"received index={index!r}.")
        self._inner, self.num_shards, self.index = inner, int(num_shards), int(index)

    def _length(self) -> int | None:
        n = self._inner._length()
        return None if n is None else max(0, -(-(n - self.index) // self.num_shards))

    def _get(self, index: int, iteration: int) -> Any:
        return self._inner._get(self.index + index * self.num_shards, iteration)

    def _gather(self, indices: np.ndarray, iteration: int) -> Any:
        return self._inner._gather(self.index + indices * self.num_shards, iteration)


class Take(Dataset):
    def __init__(self, inner: Dataset, count: int) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < -1:
            raise ValueError(f"Invalid `count`: expected an int >= -1, received count={count!r}.")
        self._inner, self.count = inner, count

    def _length(self) -> int | None:
        n = self._inner._length()
        if self.count == -1:
            return n
        return self.count if n is None else min(n, self.count)

    def _get(self, index: int, iteration: int) -> Any:
        return self._inner._get(index, iteration)

    def _gather(self, indices: np.ndarray, iteration: int) -> Any:
        return self._inner._gather(indices, iteration)


class Skip(Dataset):
    def __init__(self, inner: Dataset, count: int) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"Invalid `count`: expected an int >= 0, received count={count!r}.")
        self._inner, self.count = inner, count

    def _length(self) -> int | None:
        n = self._inner._length()
        return None if n is None else max(0, n - self.count)

    def _get(self, index: int, iteration: int) -> Any:
        return self._inner._get(index + self.count, iteration)

    def _gather(self, indices: np.ndarray, iteration: int) -> Any:
        return self._inner._gather(indices + self.count, iteration)
