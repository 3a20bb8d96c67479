"""Microbatches: gradient accumulation and activation checkpointing, with Keras 3's names.

``python examples/microbatches.py`` trains in one process; ``meshfit launch --workers 2
examples/microbatches.py`` on two workers, which all-reduce their gradients once per update.
``MESHFIT_EXAMPLE_TINY=1`` trains 2 epochs instead of 5 (the test suite runs it so).

Batches of 16 with ``gradient_accumulation_steps=4`` make the updates of batches of 64; the MLP's
layers recompute their activations in the backward pass (``RematScope(mode="full")``).
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
    strategy = mf.MultiWorkerMirroredStrategy()  # one worker without TF_CONFIG, or as launched
    (x, y), _ = mf.datasets.load_digits()  # pixels already scaled to [0, 1]
    x = x.reshape(-1, 64)
    with strategy.scope(), mf.RematScope(mode="full"):
        model = mf.Model(build_module())
        model.compile(optimizer=mf.optimizers.Adam(1e-3, gradient_accumulation_steps=4),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(x, y, batch_size=16, epochs=2 if TINY else 5, verbose=2)
    optimizer = model.optimizer
    print(f"batches {optimizer.batches}, updates {optimizer.iterations}")
    print("rematerialized:", sorted(mf.nn.rematerialized(model.module)))


if __name__ == "__main__":
    main()
