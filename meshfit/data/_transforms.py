"""The transformation nodes of a `Dataset` pipeline: each computes its element ``i`` of pass ``t``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from meshfit._validation import invalid_argument
from meshfit.data._node import AUTOTUNE, Node, Transform
from meshfit.data._structure import from_python, is_namedtuple, stack


def _check_positive_int(name: str, value: Any, allow: tuple = ()) -> None:
    if value in allow:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise invalid_argument(name, "a positive int", value)


class Shuffle(Transform):
    """Emulates ``tf.data``'s buffer shuffle with a generator seeded by (seed, pass_index)."""

    def __init__(self, inner: Node, buffer_size: int, seed: int | None, reshuffle: bool) -> None:
        _check_positive_int("buffer_size", buffer_size)
        if seed is None:
            seed = _unseeded_shuffle_seed()
        self._inner, self.buffer_size, self.seed, self.reshuffle = inner, int(buffer_size), int(seed), reshuffle
        self._cache: tuple[int, np.ndarray] | None = None

    def _length(self) -> int | None:
        return self._inner._length()

    def _replace_inner(self, inner: Node) -> Shuffle:
        clone = super()._replace_inner(inner)
        clone._cache = None  # the permutation was drawn for the old input's length
        return clone

    def reseed(self, seed: int) -> None:
        """Shuffle with ``seed`` from now on (every replica agrees on rank 0's; a resume on the saved one)."""
        if self.seed != seed:
            self.seed, self._cache = seed, None

    def _permutation(self, pass_index: int) -> np.ndarray:
        it = pass_index if self.reshuffle else 0
        cached = self._cache  # read once: a prefetch thread may replace it concurrently
        if cached is None or cached[0] != it:
            n = self._length()
            if n is None:  # _source_index shuffles infinite input by windows instead
                raise ValueError("A shuffle permutation needs finite input.")
            rng = np.random.default_rng([self.seed, it])
            cached = (it, _buffer_permutation(n, self.buffer_size, rng))
            self._cache = cached
        return cached[1]

    def _source_index(self, index: int, pass_index: int) -> int:
        if self._length() is None:  # infinite input: shuffle within consecutive windows
            window, offset = divmod(index, self.buffer_size)
            it = pass_index if self.reshuffle else 0
            perm = np.random.default_rng([self.seed, it, window]).permutation(self.buffer_size)
            return window * self.buffer_size + int(perm[offset])
        return int(self._permutation(pass_index)[index])

    def _get(self, index: int, pass_index: int) -> Any:
        return self._inner._get(self._source_index(index, pass_index), pass_index)

    def _gather(self, indices: np.ndarray, pass_index: int) -> Any:
        if self._length() is None:
            source = np.array([self._source_index(int(i), pass_index) for i in indices], dtype=np.int64)
        else:
            source = self._permutation(pass_index)[indices]
        return self._inner._gather(source, pass_index)

    def _gather_range(self, start: int, stop: int, pass_index: int) -> Any:
        # A batch's consecutive positions: a slice of the permutation (no index array made and read)
        cached = self._cache  # this pass's permutation, drawn already (`_permutation` inline: every step)
        if cached is not None and cached[0] == (pass_index if self.reshuffle else 0):
            return self._inner._gather(cached[1][start:stop], pass_index)
        if self._inner._length() is None:
            return self._gather(np.arange(start, stop, dtype=np.int64), pass_index)
        return self._inner._gather(self._permutation(pass_index)[start:stop], pass_index)


def _unseeded_shuffle_seed() -> int:
    """A seed for ``shuffle(seed=None)``, drawn from torch's global generator.

    As ``torch.utils.data.RandomSampler`` draws its seed: ``torch.manual_seed(s)`` makes a program's
    orders reproducible (TF's ``tf.random.set_seed`` resets its op-seed counter to the same effect),
    and two shuffles in one program get different orders. The draw advances torch's generator once.
    """
    import torch

    return int(torch.randint(0, 2**62, (), dtype=torch.int64))


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


class Repeat(Transform):
    """``count`` passes over the input; forever when ``count`` is None or negative (as in TF)."""

    def __init__(self, inner: Node, count: int | None) -> None:
        if count is not None and (isinstance(count, bool) or not isinstance(count, (int, np.integer))):
            raise ValueError(f"Invalid `count`: expected an int (negative or None: forever), received count={count!r}.")
        self._inner, self.count = inner, None if count is None or count < 0 else int(count)

    def _length(self) -> int | None:
        n = self._inner._length()
        if n == 0 or self.count == 0:  # nothing to repeat: empty, as in TF (even when repeating forever)
            return 0
        if n is None or self.count is None:
            return None
        return n * self.count

    def _locate(self, index: int, pass_index: int) -> tuple[int, int]:
        n = self._inner._length()
        if n is None:
            return index, pass_index
        if n == 0:
            raise StopIteration
        # Pass ``pass_index`` of a finite repeat covers inner passes ``[pass_index*count, ...)``; passes
        # of an infinite one are kept apart by a large stride.
        passes = pass_index * (2**32 if self.count is None else self.count)
        return index % n, passes + index // n

    def _get(self, index: int, pass_index: int) -> Any:
        return self._inner._get(*self._locate(index, pass_index))

    def _gather(self, indices: np.ndarray, pass_index: int) -> Any:
        n = self._inner._length()
        if n is None:
            return self._inner._gather(indices, pass_index)
        if n == 0:
            raise StopIteration
        indices = np.asarray(indices, dtype=np.int64)
        passes = pass_index * (2**32 if self.count is None else self.count) + indices // n
        if not len(passes) or (passes == passes[0]).all():  # the usual case: the batch lies in one inner pass
            return self._inner._gather(indices % n, int(passes[0]) if len(passes) else pass_index)
        return stack([self._inner._get(int(i), int(t)) for i, t in zip(indices % n, passes, strict=True)])

    def _gather_range(self, start: int, stop: int, pass_index: int) -> Any:
        # The usual batch (consecutive positions within one inner pass): the inner node's own range,
        # with no index array made, divided and compared
        n = self._inner._length()
        if n and start // n == max(stop - 1, start) // n:  # (an empty range: a replica's empty share)
            inner_pass = pass_index * (2**32 if self.count is None else self.count) + start // n
            return self._inner._gather_range(start % n, start % n + stop - start, inner_pass)
        return self._gather(np.arange(start, stop, dtype=np.int64), pass_index)


class Batch(Transform):
    def __init__(self, inner: Node, batch_size: int, drop_remainder: bool) -> None:
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

    def _get(self, index: int, pass_index: int) -> Any:
        # `_length` and `rows` inlined (a batch a step): the input's length is read once, not twice.
        n, size = self._inner._length(), self.batch_size
        start = index * size
        stop = start + size
        if n is not None:
            if index >= (n // size if self.drop_remainder else -(-n // size)):
                raise IndexError(index)
            if n < stop:
                stop = n
        return self._inner._gather_range(start, stop, pass_index)

    def get_rows(self, index: int, pass_index: int, start: int, stop: int) -> Any:
        """Rows ``[start, stop)`` (relative) of batch ``index``, computing only those."""
        first, last = self.rows(index)
        lo, hi = min(first + start, last), min(first + stop, last)
        return self._inner._gather_range(lo, hi, pass_index)


class Map(Transform):
    """``map_func`` over each element: a tuple is unpacked into arguments, anything else (a namedtuple,
    a dict, a tensor) is passed whole; the result follows ``tf.data``'s rules (a returned list is a tuple)."""

    def __init__(self, inner: Node, fn: Callable[..., Any]) -> None:
        if not callable(fn):
            raise TypeError(f"Invalid `map_func`: expected a callable, received {fn!r}.")
        self._inner, self.fn = inner, fn

    def _length(self) -> int | None:
        return self._inner._length()

    def _get(self, index: int, pass_index: int) -> Any:
        element = self._inner._get(index, pass_index)
        try:
            out = self.fn(*element) if isinstance(element, tuple) and not is_namedtuple(element) else self.fn(element)
        except StopIteration as error:  # never the end of the data: an error in this element, as in TF
            raise RuntimeError(f"`map_func` {_name(self.fn)} raised StopIteration on element {index}; a map "
                               "function cannot end a dataset. Use take() or a shorter input.") from error
        return from_python(tuple(out) if isinstance(out, list) else out)


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


class Cache(Transform):
    def __init__(self, inner: Node) -> None:
        self._inner = inner
        self._store: dict[int, Any] = {}

    def forget(self) -> None:
        """Drop the elements held: the input below changed (a shuffle reseeded), so they are another order's."""
        self._store = {}

    def _replace_inner(self, inner: Node) -> Cache:
        clone = super()._replace_inner(inner)
        clone._store = {}  # the cached elements are the old input's, not the new one's
        return clone

    def _length(self) -> int | None:
        return self._inner._length()

    def _get(self, index: int, pass_index: int) -> Any:
        if index not in self._store:
            self._store[index] = self._inner._get(index, 0)
        return self._store[index]


class Prefetch(Transform):
    def __init__(self, inner: Node, buffer_size: int) -> None:
        _check_positive_int("buffer_size", buffer_size, allow=(AUTOTUNE, 0))
        self._inner, self.buffer_size = inner, 2 if buffer_size == AUTOTUNE else int(buffer_size)

    def _length(self) -> int | None:
        return self._inner._length()

    def _get(self, index: int, pass_index: int) -> Any:
        return self._inner._get(index, pass_index)

    def _gather(self, indices: np.ndarray, pass_index: int) -> Any:
        return self._inner._gather(indices, pass_index)

    def _gather_range(self, start: int, stop: int, pass_index: int) -> Any:
        return self._inner._gather_range(start, stop, pass_index)

    def _prefetch_size(self) -> int:
        return max(self.buffer_size, self._inner._prefetch_size())


class Shard(Transform):
    def __init__(self, inner: Node, num_shards: int, index: int) -> None:
        _check_positive_int("num_shards", num_shards)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_shards:
            raise ValueError(f"Invalid `index`: expected 0 <= index < num_shards={num_shards}, "
                             f"received index={index!r}.")
        self._inner, self.num_shards, self.index = inner, int(num_shards), int(index)

    def _length(self) -> int | None:
        n = self._inner._length()
        return None if n is None else max(0, -(-(n - self.index) // self.num_shards))

    def _get(self, index: int, pass_index: int) -> Any:
        return self._inner._get(self.index + index * self.num_shards, pass_index)

    def _gather(self, indices: np.ndarray, pass_index: int) -> Any:
        return self._inner._gather(self.index + indices * self.num_shards, pass_index)


class Take(Transform):
    def __init__(self, inner: Node, count: int) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < -1:
            raise ValueError(f"Invalid `count`: expected an int >= -1, received count={count!r}.")
        self._inner, self.count = inner, count

    def _length(self) -> int | None:
        n = self._inner._length()
        if self.count == -1:
            return n
        return self.count if n is None else min(n, self.count)

    def _get(self, index: int, pass_index: int) -> Any:
        return self._inner._get(index, pass_index)

    def _gather(self, indices: np.ndarray, pass_index: int) -> Any:
        return self._inner._gather(indices, pass_index)

    def _gather_range(self, start: int, stop: int, pass_index: int) -> Any:
        return self._inner._gather_range(start, stop, pass_index)


class Skip(Transform):
    def __init__(self, inner: Node, count: int) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"Invalid `count`: expected an int >= 0, received count={count!r}.")
        self._inner, self.count = inner, count

    def _length(self) -> int | None:
        n = self._inner._length()
        return None if n is None else max(0, n - self.count)

    def _get(self, index: int, pass_index: int) -> Any:
        return self._inner._get(index + self.count, pass_index)

    def _gather(self, indices: np.ndarray, pass_index: int) -> Any:
        return self._inner._gather(indices + self.count, pass_index)

    def _gather_range(self, start: int, stop: int, pass_index: int) -> Any:
        return self._inner._gather_range(start + self.count, stop + self.count, pass_index)


def reseed_shuffles(top: Node, seeds: list[int], previous: list[int] | None = None) -> None:
    """Give the shuffles of the pipeline ending at ``top`` (top first, as ``top.nodes()`` lists them) the
    ``seeds``. A cache above a shuffle whose seed changes forgets what it holds: those elements were read in
    the old order, and kept they would repeat some examples and skip others in the new one. ``previous``:
    the seeds the shuffles had before, where another pipeline sharing them (a replica's view of a dataset)
    was reseeded first."""
    nodes = top.nodes()
    shuffles = [node for node in nodes if isinstance(node, Shuffle)]
    if len(shuffles) != len(seeds):
        raise ValueError(f"reseed_shuffles: the pipeline has {len(shuffles)} shuffles, received {len(seeds)} seeds.")
    before = previous if previous is not None else [shuffle.seed for shuffle in shuffles]
    for shuffle, seed, old in zip(shuffles, seeds, before, strict=True):
        if old == seed:
            continue
        if shuffle.seed != seed:
            shuffle.reseed(seed)
        for node in nodes:  # the nodes above it
            if node is shuffle:
                break
            if isinstance(node, Cache):
                node.forget()
