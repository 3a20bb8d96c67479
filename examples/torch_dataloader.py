"""A torch ``DataLoader`` on several workers: pass it with the global batch size, meshfit splits each
batch across the replicas and seeds a shuffling sampler the same on every worker, once per epoch.

``meshfit launch --workers 2 examples/torch_dataloader.py`` (or ``python examples/torch_dataloader.py``
for one process). ``MESHFIT_EXAMPLE_TINY=1`` trains 2 epochs instead of 5 (the test suite runs it so).
"""

from __future__ import annotations

import os
import tempfile

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import meshfit as mf

TINY = os.environ.get("MESHFIT_EXAMPLE_TINY") == "1"


def main() -> None:
    torch.manual_seed(0)
    strategy = mf.MultiWorkerMirroredStrategy()
    (x, y), _ = mf.datasets.load_digits()  # pixels already scaled to [0, 1]: use them as they are
    dataset = TensorDataset(torch.from_numpy(x.reshape(-1, 64)), torch.from_numpy(y))
    global_batch = 32 * strategy.num_replicas_in_sync
    loader = DataLoader(dataset, batch_size=global_batch, shuffle=True)  # the global batch, as in Keras

    with strategy.scope():
        model = mf.Model(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
        model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    backup_dir = os.path.join(tempfile.gettempdir(), "meshfit-loader-backup")
    model.fit(loader, epochs=2 if TINY else 5, callbacks=[mf.callbacks.BackupAndRestore(backup_dir)], verbose=2)


if __name__ == "__main__":
    main()
