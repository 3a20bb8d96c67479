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
