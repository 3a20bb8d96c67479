"""`DistributedDataset`: which rows of each global batch this replica reads.

The global order of examples is the dataset's own; the policy only picks this replica's share:

========  =====================================================================================
policy    replica ``r`` of ``n`` at step ``i``
========  =====================================================================================
DATA      rows ``[r*g//n, (r+1)*g//n)`` of global batch ``i`` (``g`` its size): the steps see the
          same examples for any ``n``
FILE      batch ``i`` of its own pipeline over files ``r, r+n, ...``, batched per replica
OFF       batch ``i`` of the whole dataset batched per replica: every replica sees the same data
========  =====================================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from meshfit.data import (
    AutoShardPolicy,
    Batch,
    Dataset,
    Files,
    Node,
    Options,
    Prefetch,
    Shuffle,
    Skip,
    Take,
    batch_size_of,
    reseed_shuffles,
    slice_rows,
)
from meshfit.distribute._values import InputContext


def agree_on_shuffle_seeds(dataset: Dataset, broadcast: Callable[[Any], Any]) -> None:
    """Every replica shuffles with rank 0's seeds (``shuffle(seed=None)`` may differ per process)."""
    if not isinstance(dataset, Dataset):
        return  # DistributedDataset's own check names the type
    shuffles = [node for node in dataset.node.nodes() if isinstance(node, Shuffle)]
    reseed_shuffles(dataset.node, broadcast([node.seed for node in shuffles]))


def _top_batch(dataset: Dataset) -> Batch | None:
    for node in dataset.node.nodes():
        if isinstance(node, Batch):
            return node
    return None


class DistributedDataset:
    """This replica's view of a dataset batched with the global batch size."""

    context: InputContext | None = None  # set for a dataset that ``dataset_fn(context)`` built

    def __init__(self, dataset: Dataset, context: InputContext, options: Options | None = None) -> None:
        if isinstance(dataset, DistributedDataset):
            raise TypeError("The dataset is already distributed; pass the plain meshfit.data.Dataset.")
        if not isinstance(dataset, Dataset):
            raise TypeError(f"Invalid `dataset`: expected a meshfit.data.Dataset, received {type(dataset).__name__}.")
        self.dataset = dataset
        self.num_replicas = context.num_input_pipelines
        self.replica_id = context.input_pipeline_id
        self.policy = (options or dataset.options()).auto_shard_policy
        self.view = dataset
        if self.num_replicas > 1:
            self._build_view()

    @classmethod
    def from_per_replica(cls, dataset: Dataset, context: InputContext) -> DistributedDataset:
        """A dataset that ``dataset_fn(InputContext)`` built for this replica alone."""
        if not isinstance(dataset, Dataset):
            raise TypeError(f"`dataset_fn` must return a meshfit.data.Dataset, received {type(dataset).__name__}.")
        self = cls.__new__(cls)
        self.dataset = self.view = dataset
        self.num_replicas, self.replica_id = context.num_input_pipelines, context.input_pipeline_id
        self.policy, self.context = AutoShardPolicy.OFF, context
        return self

    def _build_view(self) -> None:
        n, r = self.num_replicas, self.replica_id
        batch = _top_batch(self.dataset)
        if batch is None:
            raise ValueError("A distributed dataset must be batched with the global batch size, e.g. "
                             f"dataset.batch({64 * n}) for 64 examples per replica; this one has no batch().")
        if batch.batch_size % n:
            raise ValueError(f"The global batch size {batch.batch_size} is not divisible by the {n} replicas "
                             f"in sync. Use a multiple of {n}, e.g. batch({batch.batch_size - batch.batch_size % n or n}).")
        per_replica = batch.batch_size // n
        policy = self.policy
        source = self.dataset.node.nodes()[-1]
        if policy is AutoShardPolicy.AUTO:
            policy = AutoShardPolicy.FILE if isinstance(source, Files) else AutoShardPolicy.DATA
        if policy is AutoShardPolicy.FILE and not isinstance(source, Files):
            raise ValueError("AutoShardPolicy.FILE needs a file-based source (Dataset.from_files or "
                             "Dataset.list_files); this dataset comes from memory. Use AutoShardPolicy.DATA.")
        self.policy = policy
        if policy is AutoShardPolicy.DATA:
            return

        def rebatch(node: Node) -> Node | None:
            if node is batch:
                inner = batch.inner
                if policy is AutoShardPolicy.FILE and isinstance(source, Files):  # (FILE needs Files: above)
                    files = source
                    inner = inner.transform_chain(lambda m: files.shard_files(n, r) if m is files else None)
                return Batch(inner, per_replica, batch.drop_remainder)
            return None

        self.view = Dataset(self.dataset.node.transform_chain(rebatch))

    # ---- random access -------------------------------------------------------------------
    def length(self) -> int | None:
        """Number of steps (global batches) per pass, ``None`` when infinite."""
        return self.view.node.length()

    def replica_batch(self, index: int, pass_index: int) -> tuple[Any, int]:
        """This replica's batch ``index`` of pass ``pass_index``, and the global batch's size."""
        if self.num_replicas == 1:
            element = self.view.node.get(index, pass_index)
            return element, batch_size_of(element)
        if self.policy is not AutoShardPolicy.DATA:
            element = self.view.node.get(index, pass_index)
            return element, batch_size_of(element) * self.num_replicas
        n, r = self.num_replicas, self.replica_id
        located = self._locate_batch(index)
        if located is not None:
            batch, batch_index = located
            start, stop = batch.rows(batch_index)
            size = stop - start
            element = batch.get_rows(batch_index, pass_index, r * size // n, (r + 1) * size // n)
            return element, size
        element = self.view.node.get(index, pass_index)
        size = batch_size_of(element)
        return slice_rows(element, r * size // n, (r + 1) * size // n), size

    def _locate_batch(self, index: int) -> tuple[Batch, int] | None:
        """Follow ``index`` down through index-preserving nodes to the top ``Batch``, if possible."""
        for node in self.view.node.nodes():
            if isinstance(node, Batch):
                length = node.length()
                if length is not None and index >= length:
                    raise IndexError(index)
                return node, index
            if isinstance(node, Skip):
                index += node.count
            elif not isinstance(node, (Prefetch, Take)):
                return None
        return None

    @property
    def replicas_read_different_rows(self) -> bool:
        """False when every replica reads the same examples (``OFF``)."""
        return self.policy is not AutoShardPolicy.OFF or self.context is not None

    replays_exactly = True  # a position is computed from the pipeline's seeds, never replayed

    def prefetch_size(self) -> int:
        return self.view.node.prefetch_size()

    _next_pass = 0

    def start_pass(self) -> int:
        """The pass a new iterator (or ``fit``) over this object starts at; later ones get the next."""
        start = self._next_pass
        self._next_pass = start + 1
        return start

    def end_pass(self, pass_index: int) -> None:
        """Passes up to ``pass_index`` were read (by ``fit``): the next iterator starts after it."""
        self._next_pass = max(self._next_pass, pass_index + 1)

    # ---- Stateful: a custom loop's checkpoint can track the dataset ------------------------
    def state_dict(self) -> dict[str, int]:
        """``{"next_pass": n}``: the pass the next ``iter()`` starts (each pass has its own shuffle)."""
        return {"next_pass": self._next_pass}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Make the next ``iter()`` start the saved pass, so a resumed loop reads the same order."""
        self._next_pass = int(state["next_pass"])

    def __iter__(self) -> Iterator[Any]:
        """This replica's batches of the next pass (for custom training loops)."""
        length, index, pass_index = self.length(), 0, self.start_pass()
        while length is None or index < length:
            yield self.replica_batch(index, pass_index)[0]
            index += 1

    def __repr__(self) -> str:
        return (f"<DistributedDataset replica {self.replica_id} of {self.num_replicas}, "
                f"policy={self.policy.name}>")
