"""keras.io's MLP (784-256-256-10, Adam, batch 32) trained by meshfit's ``fit``; a process of ``bench_all.py``.

The model of keras.io's "Multi-GPU and distributed training" guide, on the digits ``bench_all.py``
saves to --data (the same file ``_mlp_keras.py`` reads). The first epoch is a warm-up.
"""

import argparse
import json
import time

import numpy as np
import torch
from torch import nn

import meshfit as mf


class EpochClock(mf.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.marks = []

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            self.marks.append((time.perf_counter(), time.process_time()))

    def on_train_end(self, logs=None):
        self.marks.append((time.perf_counter(), time.process_time()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--jit-compile", choices=["auto", "true", "false"], default="auto",
                        help="compile(jit_compile=...): Keras's values")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = np.load(args.data)
    dataset = mf.data.Dataset.from_tensor_slices((data["x"], data["y"])).repeat().batch(32)
    model = mf.Model(nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                   nn.Linear(256, 10)))
    model.compile(optimizer=mf.optimizers.Adam(), loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[mf.metrics.SparseCategoricalAccuracy()],
                  jit_compile={"true": True, "false": False}.get(args.jit_compile, "auto"))
    clock = EpochClock()
    model.fit(dataset, epochs=args.epochs, steps_per_epoch=args.steps, verbose=0, callbacks=[clock])
    (w0, c0), (w1, c1) = clock.marks
    timed = (args.epochs - 1) * args.steps
    with open(args.out, "w") as f:
        json.dump({"ms_per_step": (w1 - w0) * 1e3 / timed, "cpu_ms_per_step": (c1 - c0) * 1e3 / timed}, f)


if __name__ == "__main__":
    main()
