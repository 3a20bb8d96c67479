"""`DataHandler`: user input (Dataset, arrays, torch data) as this replica's batches, with a position.

The position is ``(pass, index)``: the pass over the data and the global batch within it. It
is all the state a resume needs, because every batch can be computed from it directly.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import numpy as np
import torch

from meshfit._engine._fit_arguments import batch_and_shuffle
from meshfit._engine._stream_source import EndOfData as EndOfData  # the loop reads it from here
from meshfit._engine._stream_source import _StreamSource
from meshfit._protocols import DataSource, DistributionStrategy
from meshfit._storage import StateMismatchError
from meshfit._validation import invalid_argument
from meshfit.data import (
    AutoShardPolicy,
    Dataset,
    Prefetcher,
    Shuffle,
    TorchMapDataset,
    data_topology,
    leaves,
    reseed_shuffles,
    to_tensor,
    topology_mismatches,
)
from meshfit.distribute import DistributedDataset, LoaderPlan, PerReplicaLoader


def _is_array_like(x: Any) -> bool:
    if isinstance(x, (np.ndarray, torch.Tensor)):
        return True
    if isinstance(x, dict):
        return all(_is_array_like(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return len(x) > 0 and all(_is_array_like(v) or isinstance(v, (int, float)) for v in x)
    return False


class DataHandler:
    """Batches for one ``fit``/``evaluate``/``predict`` call, on this replica.

    Args:
        x, y, sample_weight: the user's input, as ``Model.fit`` takes it.
        batch_size: global batch size for array inputs (default 32).
        steps: steps per epoch (``steps_per_epoch``/``steps``). As in Keras 3, an epoch also ends
            where the pass over finite data ends (the next epoch starts a new pass); without it an
            epoch is one pass, however long (data of unknown length runs until it ends).
        shuffle: shuffle array inputs every epoch (``"batch"``: whole batches).
        strategy: the strategy whose replica this is.
        argument: the name of the steps argument, for error messages.
        unbounded_ok: infinite data without ``steps`` is one endless epoch (Keras allows it in ``fit``;
            meshfit when a callback may stop training).
    """

    def __init__(self, x: Any, y: Any, sample_weight: Any, batch_size: int | None, steps: int | None,
                 shuffle: bool | str, strategy: DistributionStrategy, argument: str = "steps_per_epoch",
                 unbounded_ok: bool = False) -> None:
        self.strategy = strategy
        self._argument = argument
        # Like a fresh tf.data iterator, each fit() on the same dataset object starts a new pass
        # (reshuffled) instead of replaying the batches the previous call trained on.
        training = argument == "steps_per_epoch"
        self._origin = x if training and isinstance(x, (Dataset, DistributedDataset)) else None
        self.source: DataSource = self._adapt(x, y, sample_weight, batch_size, shuffle, steps)
        length = self.source.length()
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0):
            raise invalid_argument(argument, "a positive int or None", steps)
        if steps is None and length is None and not unbounded_ok and not isinstance(self.source, _StreamSource):
            stop = " (or, in fit, a callback that stops training, such as EarlyStopping)" if training else ""
            raise ValueError(f"The input data is infinite (e.g. it ends with .repeat()), so `{argument}` must "
                             f"be given{stop}: received {argument}=None. Pass the number of batches per epoch.")
        if length == 0:
            raise ValueError("The input data is empty: it yields no batch.")
        self.steps: int | None = steps if steps is not None else length  # None: until the data ends
        self.steps_per_epoch = steps
        self._length = length
        self.exhausted = False  # the pass of unknown length ended (EndOfData) in this epoch
        self._warned = False
        self.pass_index, self.index = (self._origin.start_pass() if self._origin is not None else 0), 0
        self._check_same_length_everywhere(length, steps, argument)
        self._prefetcher: Prefetcher | None = None
        self._prefetch_from: tuple[int, int] | None = None
        self._prefetch_size = self.source.prefetch_size()  # the pipeline's, fixed: not asked at every step

    # ---- input adaptation ----------------------------------------------------------------
    def _adapt(self, x: Any, y: Any, sample_weight: Any, batch_size: int | None, shuffle: bool | str,
               steps: Any = None) -> DataSource:
        if isinstance(x, DistributedDataset):
            self._reject_extra(x, y, sample_weight, batch_size)
            return x
        if isinstance(x, Dataset):
            self._reject_extra(x, y, sample_weight, batch_size)
            return self.strategy.experimental_distribute_dataset(x)
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size <= 0):
            raise ValueError(f"Invalid `batch_size`: expected a positive int, received batch_size={batch_size!r}.")
        if _is_array_like(x):
            parts = tuple(p for p in (x, y, sample_weight) if p is not None)
            lengths = {len(leaf) for leaf in _leaves(parts)}
            if len(lengths) != 1:
                named = ", ".join(f"{name}: {sorted({len(leaf) for leaf in _leaves(value)})}"
                                  for name, value in (("x", x), ("y", y), ("sample_weight", sample_weight))
                                  if value is not None)
                raise ValueError(f"Invalid input: x, y and sample_weight must have the same number of samples, "
                                 f"received lengths {sorted(lengths)} ({named}).")
            # Keras packs a list/tuple x alone as ``(x,)``: several inputs, not ``(x, y)``.
            alone = len(parts) > 1 or isinstance(x, (list, tuple))
            # Keras's structure rules (a list x is several inputs), not tf.data's (a list is one tensor).
            dataset = Dataset.from_tensor_slices(to_tensor(parts if alone else parts[0]))
            samples = lengths.pop()
            if batch_size is None:  # Keras: the samples over the steps asked for (one pass an epoch), else 32
                batch_size = -(-samples // steps) if isinstance(steps, int) and not isinstance(steps, bool) \
                    and steps > 0 and samples else 32
            dataset = batch_and_shuffle(dataset, samples, batch_size, shuffle,
                                        seed=_shuffle_seed() if shuffle else None)
            return self.strategy.experimental_distribute_dataset(dataset)
        if x is None:
            raise ValueError("Invalid `x`: expected input data (a meshfit Dataset, arrays or a torch "
                             "Dataset/DataLoader), received x=None.")
        if isinstance(x, torch.utils.data.DataLoader) or (hasattr(x, "__iter__") and not hasattr(x, "__getitem__")):
            self._reject_extra(x, y, sample_weight, batch_size)
            context, per_replica = self.strategy.input_context(), isinstance(x, PerReplicaLoader)
            plan = LoaderPlan(x.loader if per_replica else x, context, self.strategy.broadcast_object,
                              self.strategy.all_gather_object, per_replica=per_replica)
            return _StreamSource(plan.loader, context, plan)
        if hasattr(x, "__getitem__") and hasattr(x, "__len__"):
            if y is not None:
                raise ValueError("Invalid `y`: a torch Dataset yields (x, y) pairs itself; pass y=None.")
            dataset = batch_and_shuffle(Dataset(TorchMapDataset(x)), len(x), batch_size or 32, shuffle,
                                        seed=_shuffle_seed() if shuffle else None)
            return self.strategy.experimental_distribute_dataset(dataset)
        raise TypeError(f"Invalid `x`: expected a meshfit.data.Dataset, numpy arrays, torch tensors, a torch "
                        f"Dataset or DataLoader, received {type(x).__name__}.")

    @staticmethod
    def _reject_extra(x: Any, y: Any, sample_weight: Any, batch_size: Any) -> None:
        kind = type(x).__name__
        if y is not None:
            raise ValueError(f"Invalid `y`: when x is a {kind}, it yields the targets itself; pass y=None.")
        if sample_weight is not None:
            raise ValueError(f"Invalid `sample_weight`: when x is a {kind}, it yields the weights itself.")
        if batch_size is not None:
            raise ValueError(f"Invalid `batch_size`: a {kind} is already batched; pass batch_size=None.")

    def _check_same_length_everywhere(self, length: int | None, steps: int | None, argument: str) -> None:
        """Replicas that read their own pipelines (FILE, OFF, per-replica functions, loaders) must
        agree on the number of steps, or the ones that run out first leave the others waiting."""
        if self.strategy.num_replicas_in_sync == 1 or steps is not None:
            return
        if isinstance(self.source, DistributedDataset) and self.source.policy is AutoShardPolicy.DATA:
            return
        lengths = self.strategy.all_gather_object(length)
        if len(set(lengths)) > 1:
            listing = ", ".join(f"replica {r}: {n}" for r, n in enumerate(lengths))
            raise ValueError(f"The replicas' input pipelines have different numbers of batches ({listing}), "
                             f"so they would not take the same steps. Pass `{argument}` (and .repeat() the "
                             "data), or balance the files across workers.")

    # ---- iterating ------------------------------------------------------------------------
    def _normalized(self) -> tuple[int, int]:
        if self._length is not None and self.index >= self._length:
            return self.pass_index + 1, 0
        return self.pass_index, self.index

    def _produce(self, offset: int) -> tuple[Any, int]:
        if self._prefetch_from is None:  # next_batch sets it before it starts the prefetcher
            raise RuntimeError("DataHandler: prefetching started without a position.")
        pass_index, index = self._prefetch_from
        if self._length is not None:
            pass_index, index = pass_index + (index + offset) // self._length, (index + offset) % self._length
        else:
            index += offset
        return self.source.replica_batch(index, pass_index)

    @property
    def length_known(self) -> bool:
        """Whether the data's batches per pass are known (False: a stream read until it ends)."""
        return self._length is not None or not isinstance(self.source, _StreamSource)

    def execution_size(self, step: int, steps_per_execution: int) -> int:
        """How many steps the next execution of an epoch at ``step`` runs (Keras 3's rule).

        ``steps_per_execution``, never past the end of the pass: an epoch ends where the pass ends,
        and the next epoch starts a new one. As Keras 3's ``EpochIterator``, an execution that starts
        before ``steps`` runs in full (``steps=5``, 2 per execution: steps 0-1, 2-3, 4-5), and one at
        ``steps`` or beyond is not run. 0: the epoch is over. Warns once when ``steps`` asked for
        more batches than the pass had left.
        """
        count = steps_per_execution if self.steps is None or step < self.steps else 0
        length = self._length
        if length is not None:
            left = length - self.index
            if left <= 0:
                self.ran_out(step)
                return 0
            if left < count:
                count = left
        if self.exhausted:
            self.ran_out(step)
            return 0
        return count

    def ran_out(self, step: int) -> None:
        """The pass ended at ``step`` of the epoch: warn once if ``steps`` wanted more (as Keras does)."""
        if self.steps_per_epoch is not None and step < self.steps_per_epoch and not self._warned:
            self._warned = True
            warnings.warn("Your input ran out of data; the epoch ended early. Make sure that your data can "
                          f"generate at least `{self._argument}` batches (the next epoch starts a new pass); "
                          "you may need .repeat() on your dataset.", stacklevel=4)

    def mark_exhausted(self) -> None:
        """Another replica's data ended: this pass is over here too."""
        self.exhausted = True

    def start_epoch(self) -> None:
        """An epoch begins: after a finished pass, a new one."""
        self.pass_index, self.index = self._normalized()
        self.exhausted = False

    def next_batch(self) -> tuple[Any, int]:
        """This replica's next batch and the global batch size; advances the position.

        Raises:
            EndOfData: data of unknown length ended; the position moves to the next pass.
        """
        if self._length is not None and self.index >= self._length:  # `_normalized`, inline (every step)
            self.pass_index, self.index = self.pass_index + 1, 0
        size = self._prefetch_size
        if size:
            if self._prefetcher is None:
                self._prefetch_from = (self.pass_index, self.index)
                self._prefetcher = Prefetcher(self._produce, 0, size)
            batch = self._prefetcher.get()
        else:
            try:
                batch = self.source.replica_batch(self.index, self.pass_index)
            except EndOfData:
                self.exhausted = True
                raise
        self.index += 1
        return batch

    def peek(self) -> Any:
        """The next batch, without moving (used to build lazy modules)."""
        pass_index, index = self._normalized()
        return self.source.replica_batch(index, pass_index)[0]

    def end_epoch(self) -> None:
        """Close the pass when it ended in this epoch (the next epoch starts a new one, as in Keras 3);
        an epoch that ended at ``steps`` inside the pass leaves the next epoch to continue it."""
        if self.exhausted:
            self.pass_index, self.index, self.exhausted = self.pass_index + 1, 0, False
        else:
            self.pass_index, self.index = self._normalized()

    def close(self) -> None:
        if self._origin is not None:
            self._origin.end_pass(self.pass_index)
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    # ---- Stateful ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The data position: ``{"pass": pass, "index": global batches read in it,
        "shuffle_seeds": the pipeline's shuffle seeds}`` (a resume reads the order it saved), and
        ``"topology"``: what the position means (`meshfit.data._topology.data_topology`); for a torch
        loader, ``"loader"``: its shuffle generators' states at the pass's start (`LoaderPlan.state_dict`)."""
        chains = self._shuffle_chains()
        state = {"pass": self.pass_index, "index": self.index,
                 "shuffle_seeds": [node.seed for node in chains[0][1]] if chains else [],
                 "topology": self._topology()}
        if isinstance(self.source, _StreamSource):  # a loader's shuffle generators at the pass's start
            state["loader"] = self.source.plan.state_dict(self._normalized()[0])
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Move to a saved position; refuse one saved on other data (`StateMismatchError`).

        The shuffle seeds are part of the position (restored); the dataset's length, the global
        batch size, ``drop_remainder`` and the shuffle buffers must be the saved ones, or the
        position would name other examples. The number of replicas may differ.
        """
        saved, current = state.get("topology") or {}, self._topology()
        mismatches = topology_mismatches(saved, current)
        if mismatches and self._starts_a_pass(state) and not topology_mismatches(
                {k: v for k, v in saved.items() if k not in _BATCHING}, current):
            # At a pass boundary the position names no example yet: a new batch size is well defined.
            if self.strategy.is_chief:
                print(f"meshfit: resuming at the start of pass {state['pass']} with new batching "
                      f"({'; '.join(mismatches)})", file=sys.stderr, flush=True)
            mismatches = []
        if mismatches:
            raise StateMismatchError(
                f"The saved data position (pass {state['pass']}, global batch {state['index']}) was taken on other "
                f"data: {'; '.join(mismatches)}. Restored here it would read other examples than the run that "
                "saved it. Resume with the same dataset, batch size, drop_remainder and shuffle as that run "
                "(the number of workers may change; the batch size may change at the start of a pass, "
                "e.g. with BackupAndRestore(save_freq='epoch')).")
        self.close()
        self.pass_index, self.index = int(state["pass"]), int(state["index"])
        if isinstance(self.source, _StreamSource) and state.get("loader"):
            self.source.plan.load_state_dict(state["loader"])
        seeds = [int(seed) for seed in state.get("shuffle_seeds") or []]
        chains = self._shuffle_chains()
        previous = [[node.seed for node in chain] for _, chain in chains]  # before any: views share shuffles
        for (top, chain), before in zip(chains, previous, strict=True):
            if len(chain) == len(seeds):  # (a cache above a reseeded shuffle forgets the old order's rows)
                reseed_shuffles(top, seeds, before)

    @staticmethod
    def _starts_a_pass(state: dict[str, Any]) -> bool:
        """Whether a saved position is at the start of a pass (an epoch's end moved it there).

        A step's backup after a pass's last batch (index == its length) is not: its epoch has not
        ended, and the loop would count the new pass's first batches into it.
        """
        return int(state["index"]) == 0

    def _topology(self) -> dict[str, Any]:
        source, data, factor, own_data = self.source, None, 1, False
        if isinstance(source, DistributedDataset):
            per_replica_pipeline = source.context is not None  # a dataset_fn built it for one replica
            own_data = per_replica_pipeline or source.policy is AutoShardPolicy.FILE
            # The user's dataset, batched with the global batch size, whatever view a replica reads; a
            # dataset_fn's pipeline holds one replica's batches.
            data = source.view if per_replica_pipeline else source.dataset
            factor = source.num_replicas if per_replica_pipeline else 1
        elif isinstance(source, _StreamSource):
            data = source.loader
        return data_topology(data, global_batch_factor=factor,
                             batches_per_pass=self._length, world_size=self.strategy.num_replicas_in_sync,
                             count_examples=not own_data)

    def _shuffle_chains(self) -> list[tuple[Any, list[Any]]]:
        """The top node and the shuffle nodes, in pipeline order, of the dataset and of the replica's view of
        it (rebatching a view clones the nodes above its batch, so each chain gets the seeds)."""
        chains, seen = [], set()
        views = (self.source.dataset, self.source.view) if isinstance(self.source, DistributedDataset) else ()
        for dataset in views:
            if isinstance(dataset, Dataset) and id(dataset) not in seen:
                seen.add(id(dataset))
                chains.append((dataset.node, [n for n in dataset.node.nodes() if isinstance(n, Shuffle)]))
        return chains


# what may change at a pass boundary: how a pass is cut into batches, not which examples it holds
_BATCHING = ("global_batch_size", "batches_per_pass", "drop_remainder")


def _shuffle_seed() -> int:
    """The shuffle seed of array input, drawn from torch's global generator when ``fit`` starts.

    ``torch.manual_seed(s)`` then the same ``fit`` gives the same order, in any process; the seed
    is saved with the data position, so a resume reads the order it saved even in the same process.
    """
    return int(torch.randint(0, 2**62, (), dtype=torch.int64))


def _leaves(value: Any) -> list[Any]:
    return leaves(to_tensor(value))
