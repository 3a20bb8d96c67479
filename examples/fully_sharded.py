"""Fully sharded data parallel: each process keeps 1/N of the weights, gradients and optimizer state.

`LayoutMap.fully_sharded(mesh)` splits every weight over the mesh's ``batch`` axis (torch's
``fully_shard``, per block); ``fit``, ``BackupAndRestore`` and ``model.save`` work unchanged.
``python examples/fully_sharded.py`` runs 2 local processes (the mesh starts the second itself);
``MESHFIT_EXAMPLE_TINY=1`` trains a narrower model for 2 epochs instead of 5 (the test suite runs it so).
"""

from __future__ import annotations

import os
import tempfile

import torch
from torch import nn

import meshfit as mf

TINY = os.environ.get("MESHFIT_EXAMPLE_TINY") == "1"


def build_module(width: int) -> nn.Module:
    blocks = [nn.Sequential(nn.Linear(64 if i == 0 else width, width), nn.ReLU()) for i in range(4)]
    return nn.Sequential(*blocks, nn.Linear(width, 10))


def main() -> None:
    torch.manual_seed(0)
    mesh = mf.dtensor.create_mesh([("batch", 2)], devices=["cpu:0", "cpu:1"])
    with mf.dtensor.LayoutMap.fully_sharded(mesh).scope():  # blocks=["0", "1", ...] to choose the units
        model = mf.Model(build_module(64 if TINY else 512))
        model.compile(optimizer=mf.optimizers.Adam(0.001),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    local = sum(p.to_local().numel() for p in model.module.parameters())
    total = sum(p.numel() for p in model.module.parameters())
    print(f"this process holds {local} of {total} parameters")

    (x, y), _ = mf.datasets.load_digits()  # pixels already scaled to [0, 1]: use them as they are
    dataset = mf.data.Dataset.from_tensor_slices((x.reshape(-1, 64), y))
    dataset = dataset.shuffle(len(x), seed=0).batch(64)
    backup_dir = os.path.join(tempfile.gettempdir(), "meshfit-fsdp-backup")
    model.fit(dataset, epochs=2 if TINY else 5, callbacks=[mf.callbacks.BackupAndRestore(backup_dir)], verbose=2)
    model.save(os.path.join(tempfile.gettempdir(), "meshfit-fsdp.keras"))  # full weights, any process loads it


if __name__ == "__main__":
    main()
