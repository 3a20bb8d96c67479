"""A worker that differs from its peer in one setting (by ``--case``), for the mismatch tests.

Rank 1 builds a wider hidden layer (``model``: compared when the scope exits; ``lazy_model``: lazy
layers, so the first comparison is when fit sets the module up), or passes another
``BackupAndRestore(async_save=...)`` (``async_save``). The collective timeout is 20 s. Prints the
seconds from the start of the step that fails (building the model, or fit) to the error, then
re-raises it (the exit code is not 0).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import nn

import meshfit as mf


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True, choices=["model", "lazy_model", "async_save", "none"])
    parser.add_argument("--backup-dir", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    strategy = mf.MultiWorkerMirroredStrategy(
        communication_options=mf.CommunicationOptions(timeout_seconds=20, heartbeat_timeout_seconds=4))
    rank = strategy.replica_id
    started = time.monotonic()
    hidden = 32 + (16 if rank == 1 and args.case in ("model", "lazy_model") else 0)
    try:
        with strategy.scope():
            if args.case == "lazy_model":
                model = mf.Model(nn.Sequential(nn.LazyLinear(hidden), nn.ReLU(), nn.LazyLinear(2)))
            else:
                model = mf.Model(nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 2)))
        model.compile("sgd", "mse")
        x, y = np.random.rand(64, 8).astype("float32"), np.random.rand(64, 2).astype("float32")
        backup = mf.callbacks.BackupAndRestore(args.backup_dir, save_freq=2,
                                               async_save=rank == 1 and args.case == "async_save")
        if args.case == "async_save":
            started = time.monotonic()  # the mismatch is found in fit: time fit, not the model's build
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[backup])
    except Exception:
        print(f"failed after {time.monotonic() - started:.2f} s", flush=True)
        raise
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
