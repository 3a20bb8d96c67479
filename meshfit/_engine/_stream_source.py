"""`_StreamSource`: a torch ``DataLoader`` (or any iterable of batches) as a `DataSource`, read in order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from meshfit._protocols import InputContextLike
from meshfit.data import batch_size_of, slice_rows, to_tensor
from meshfit.distribute import LoaderPlan


class EndOfData(Exception):
    """Data of unknown length (a ``DataLoader`` over an ``IterableDataset``) ran out in this pass."""




class _StreamSource:
    """A ``torch.utils.data.DataLoader`` (or any iterable of batches): read in order, not seekable.

    Each replica reads every batch and keeps its rows (DATA policy). Restoring a position replays
    the iterable from the start of the pass and skips the batches already seen.
    """

    def __init__(self, loader: Any, context: InputContextLike, plan: LoaderPlan) -> None:
        self.loader, self.num_replicas, self.replica_id = loader, context.num_input_pipelines, context.input_pipeline_id
        self.plan = plan  # which examples this replica reads (distribute/_input/_torch_loader.py)
        self._iterator: Iterator[Any] | None = None
        self._at: tuple[int, int] = (-1, -1)
        self._last: tuple[tuple[int, int], tuple[Any, int]] | None = None

    def length(self) -> int | None:
        try:
            return len(self.loader)
        except TypeError:
            return None

    def replica_batch(self, index: int, pass_index: int) -> tuple[Any, int]:
        if self._last is not None and self._last[0] == (pass_index, index):
            return self._last[1]  # peeked (to build the model): a one-shot iterable can't replay it
        result = self._read(index, pass_index)
        self._last = ((pass_index, index), result)
        return result

    def _read(self, index: int, pass_index: int) -> tuple[Any, int]:
        if self._iterator is None or self._at != (pass_index, index):
            self._iterator, skip = self.plan.iterate(pass_index), index
            try:
                for _ in range(skip):
                    next(self._iterator)
                element = next(self._iterator)
            except StopIteration:
                self._iterator, self._at = None, (-1, -1)
                raise EndOfData from None
        else:
            try:
                element = next(self._iterator)
            except StopIteration:
                self._iterator, self._at = None, (-1, -1)
                raise EndOfData from None
        element = to_tensor(element)
        if isinstance(element, list):
            element = tuple(element)
        self._at = (pass_index, index + 1)
        size = batch_size_of(element)
        n, r = self.num_replicas, self.replica_id
        if n == 1:
            return element, size
        if self.plan.sharded:
            return element, size * n  # a DistributedSampler's shares are equal
        return slice_rows(element, r * size // n, (r + 1) * size // n), size

    def prefetch_size(self) -> int:
        return 0

    replicas_read_different_rows = True

    @property
    def replays_exactly(self) -> bool:
        return self.plan.replays_exactly

    def state_dict(self) -> dict[str, Any]:
        return {}  # a stream has no position of its own: the DataHandler's is replayed


