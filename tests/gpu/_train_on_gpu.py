"""Train a small CNN on cuda:0 with backups; optionally SIGKILL itself at an iteration (tests/gpu).

Usage: python _train_on_gpu.py OUT_NPZ BACKUP_DIR KILL_AT [ASYNC]
The parent sets CUBLAS_WORKSPACE_CONFIG; deterministic algorithms make a resumed run bitwise.
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np
import torch
from torch import nn

import meshfit as mf


class KillAt(mf.callbacks.Callback):
    reads_batch_logs = False

    def __init__(self, iteration: int) -> None:
        super().__init__()
        self.iteration = iteration

    def on_train_batch_begin(self, batch, logs=None):
        if self.model.optimizer.iterations == self.iteration:
            os.kill(os.getpid(), signal.SIGKILL)  # as `kill -9` from outside: no handler, no cleanup


def main() -> None:
    out, backup, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    async_save = len(sys.argv) > 4 and sys.argv[4] == "async"
    torch.use_deterministic_algorithms(True)
    (x, y), _ = mf.datasets.load_digits()
    x, y = x[:512], y[:512]
    dataset = mf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=1).batch(32)
    torch.manual_seed(0)
    module = nn.Sequential(nn.Unflatten(1, (1, 8)), nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Dropout(0.1), nn.Flatten(),
                           nn.Linear(8 * 6 * 6, 10))
    strategy = mf.OneDeviceStrategy("cuda:0")
    with strategy.scope():
        model = mf.Model(module)
        model.compile(mf.optimizers.Adam(0.01), mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    callbacks = [mf.callbacks.BackupAndRestore(backup, save_freq=5, async_save=async_save)]
    if kill_at >= 0:
        callbacks.append(KillAt(kill_at))
    model.fit(dataset, epochs=3, verbose=0, callbacks=callbacks)
    np.savez(out, *model.get_weights())


if __name__ == "__main__":
    main()
