"""Minor page faults per step of ``fit`` after warm-up, on a scaled-down seed CNN, in a default process.

Prints one JSON line: faults per step in the warm-up epoch and in the measured epochs. Used by
tests/test_page_faults.py; run it by hand to see the number: ``python tests/scripts/fit_page_faults.py``.
"""

import argparse
import json
import resource

import numpy as np
import torch
from torch import nn

import meshfit as mf


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class FaultClock(mf.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.marks = []

    def on_epoch_begin(self, epoch, logs=None):
        self.marks.append(faults())

    def on_train_end(self, logs=None):
        self.marks.append(faults())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=20, help="image side")
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = rng.random((512, args.size, args.size), dtype=np.float32)
    y = rng.integers(0, 10, 512)
    torch.manual_seed(0)
    side = args.size - 2
    model = mf.Model(nn.Sequential(nn.Unflatten(1, (1, args.size)), nn.Conv2d(1, args.channels, 3), nn.ReLU(),
                                   nn.Flatten(), nn.Linear(args.channels * side * side, args.hidden), nn.ReLU(),
                                   nn.Linear(args.hidden, 10)))
    model.compile(optimizer=mf.optimizers.SGD(learning_rate=0.01),
                  loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    dataset = mf.data.Dataset.from_tensor_slices((x, y)).shuffle(512, seed=0).repeat().batch(64)
    clock = FaultClock()
    model.fit(dataset, epochs=args.epochs, steps_per_epoch=args.steps, verbose=0, callbacks=[clock])
    marks = clock.marks
    gradient_mb = sum(p.numel() for p in model.module.parameters()) * 4 / 2**20
    print(json.dumps({"warmup_faults_per_step": (marks[1] - marks[0]) / args.steps,
                      "faults_per_step": (marks[-1] - marks[1]) / ((args.epochs - 1) * args.steps),
                      "gradient_mb": gradient_mb}))


if __name__ == "__main__":
    main()
