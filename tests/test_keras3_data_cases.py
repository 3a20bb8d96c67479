"""Keras 3's array adapter default batch size (the samples over the steps asked for) and a torch map-style
dataset's empty share of a last global batch."""

from __future__ import annotations

import numpy as np
import torch

import meshfit as mf
from meshfit._engine._data_handler import DataHandler
from meshfit.data import Dataset, TorchMapDataset
from meshfit.distribute import InputContext
from meshfit.distribute._input._distributed_dataset import DistributedDataset


def _strategy():
    return mf.distribute.OneDeviceStrategy("cpu")


# keras/src/trainers/data_adapters/array_data_adapter.py (ArrayDataAdapter.__init__, reached from
# get_data_adapter(..., steps=steps_per_epoch)): "If batch_size is not passed but steps is, calculate
# from the input data": batch_size = ceil(num_samples / steps).
def test_array_batch_size_defaults_to_samples_over_steps():
    x = np.zeros((100, 1), dtype="float32")
    y = np.zeros(100, dtype="int64")
    handler = DataHandler(x, y, None, None, 5, False, _strategy())
    assert handler.source.length() == 5
    handler.start_epoch()
    assert [len(handler.next_batch()[0][1]) for _ in range(5)] == [20] * 5


# Not silent, but on the same path: a replica's empty share of a partial last batch of a torch
# map-style Dataset (fit(torch_dataset) on 2 replicas, 3 examples, batch 2) raises IndexError.
def test_torch_map_dataset_gives_an_empty_share():
    class Pairs(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return torch.tensor([float(i)]), torch.tensor(i)

    ds = Dataset(TorchMapDataset(Pairs())).batch(2)
    shares = [DistributedDataset(ds, InputContext(2, r, 2)).replica_batch(1, 0)[0] for r in range(2)]
    assert sorted(len(y) for _, y in shares) == [0, 1]


def _shuffled_cached(seed=None):
    return Dataset.from_tensor_slices(np.arange(8)).shuffle(8, seed=seed).cache().batch(2)


def test_a_resumed_shuffled_then_cached_pipeline_reads_each_example_once():
    # fit reads a first batch (to build the model) before a backup restores the data position: the cache
    # above the shuffle held rows of the unseeded order, and the restored seed's pass mixed both orders
    first = DataHandler(_shuffled_cached(), None, None, None, None, False, _strategy())
    first.start_epoch()
    read = [first.next_batch()[0].tolist() for _ in range(2)]
    state = first.state_dict()

    resumed = DataHandler(_shuffled_cached(), None, None, None, None, False, _strategy())
    resumed.peek()  # fills the cache with another seed's first batch
    resumed.load_state_dict(state)
    read += [resumed.next_batch()[0].tolist() for _ in range(2)]
    resumed.end_epoch()
    resumed.start_epoch()
    second_pass = [resumed.next_batch()[0].tolist() for _ in range(4)]
    assert sorted(sum(read, [])) == list(range(8))
    assert second_pass == read  # the cache keeps the first pass's order (tf.data's cache after a shuffle)


def test_reseeding_a_shuffle_empties_the_caches_above_it_only():
    from meshfit.data import reseed_shuffles

    dataset = Dataset.from_tensor_slices(np.arange(6)).cache().shuffle(6, seed=1).cache()
    before = list(dataset.as_numpy_iterator())
    reseed_shuffles(dataset.node, [2])
    assert list(dataset.as_numpy_iterator()) == list(
        Dataset.from_tensor_slices(np.arange(6)).shuffle(6, seed=2).as_numpy_iterator())
    assert sorted(before) == list(range(6))
    bottom = dataset.node.nodes()[-2]  # the cache below the shuffle keeps its rows (the input's own order)
    assert len(bottom._store) == 6
