"""Pipeline parallelism: an MLP split into two stages, one per process, trained by ``fit``.

``meshfit launch --workers 2 examples/pipeline.py`` starts the two processes (or set ``TF_CONFIG``/torchrun's
variables yourself). ``MESHFIT_EXAMPLE_TINY=1`` trains 2 epochs instead of 5 (the test suite runs it so).

The ``pipe`` axis holds the stages: the first process trains the first layer, the second process the
other two and computes the loss. Each batch of 32 flows through in 2 microbatches of 16 (torch's 1F1B
schedule); the numbers are one process's on the same batches.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import meshfit as mf

TINY = os.environ.get("MESHFIT_EXAMPLE_TINY") == "1"


def build_module() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))


def main() -> None:
    torch.manual_seed(0)
    mesh = mf.dtensor.create_mesh([("pipe", 2)])
    layout_map = mf.dtensor.LayoutMap(mesh).pipeline(split_points=["2"], microbatches=2, schedule="1F1B")
    (x, y), _ = mf.datasets.load_digits()  # pixels already scaled to [0, 1]
    x = x.reshape(-1, 64)
    with layout_map.scope():
        model = mf.Model(build_module())
        model.compile(optimizer=mf.optimizers.Adam(1e-3),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(x, y, batch_size=32, epochs=2 if TINY else 5, verbose=2)
    held = sorted(path for path in model.module.state_dict() if model.residency.holds(path))
    print(f"this process trains {held}")


if __name__ == "__main__":
    main()
