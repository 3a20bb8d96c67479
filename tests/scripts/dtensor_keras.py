"""The seed "DTensor with Keras" ported: a mesh, a LayoutMap with regex keys, fit, BackupAndRestore.

Runs as a plain ``python dtensor_keras.py --devices 4`` (the mesh starts the other local processes
itself) or under ``meshfit launch --workers 4`` / torchrun / TF_CONFIG. ``--flow custom`` runs the
seed's custom training loop instead (``pack``, ``Adam(..., mesh=mesh)``, mesh-aware metrics).
Writes each rank's full weights to ``<out>/weights-<rank>.npz`` and its layouts to
``<out>/layouts-<rank>.txt``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import numpy as np
import torch
from torch import nn

import meshfit as mf


class SubclassedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.feature = nn.Linear(64, 16)
        self.dropout = nn.Dropout(0.1)
        self.feature_2 = nn.Linear(16, 10)

    def forward(self, inputs):
        x = torch.relu(self.feature(inputs))
        x = self.dropout(x)
        return self.feature_2(x)


class Chaos(mf.callbacks.Callback):
    """SIGKILL this process before optimizer step ``kill_at`` of the first round."""

    def __init__(self, kill_rank: int, kill_at: int, rank: int, backup_dir: str | None = None) -> None:
        super().__init__()
        self.kill_rank, self.kill_at, self.rank, self.backup_dir = kill_rank, kill_at, rank, backup_dir
        self.first_round = os.environ.get("MESHFIT_RESTART_COUNT", "0") == "0"

    def on_train_batch_begin(self, batch, logs=None):
        if self.first_round and self.rank == self.kill_rank and self.model.loop_state.iterations + 1 == self.kill_at:
            if self.backup_dir:  # the asynchronous backup before the kill is committed first (a loaded machine
                deadline = time.monotonic() + 120  # may still be writing it): the restart resumes from it
                while mf.train.latest_checkpoint(self.backup_dir) is None and time.monotonic() < deadline:
                    time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=0, help="start this many local processes (plain script)")
    parser.add_argument("--mesh", default="batch=2,model=2")
    parser.add_argument("--examples", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--backup-dir", default=None)
    parser.add_argument("--save-freq", default="epoch")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--fully-sharded", action="store_true",
                        help="LayoutMap.fully_sharded(mesh) instead of the seed's hand layouts (mesh batch=N)")
    parser.add_argument("--no-keys", action="store_true",
                        help="a LayoutMap without keys: every weight replicated, DDP's path (mesh batch=N)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(1337)  # every process starts from the same seed, as the seed tutorial asks

    dims = [(name, int(size)) for name, size in (part.split("=") for part in args.mesh.split(","))]
    devices = [f"cpu:{i}" for i in range(args.devices)] if args.devices else None
    mesh = mf.dtensor.create_mesh(dims, devices=devices)
    rank = mesh.strategy.mesh.device_mesh.get_rank()

    if args.fully_sharded:
        layout_map = mf.dtensor.LayoutMap.fully_sharded(mesh)
    elif args.no_keys:
        layout_map = mf.dtensor.LayoutMap(mesh=mesh)
    else:
        layout_map = mf.dtensor.LayoutMap(mesh=mesh)
        layout_map["feature.*weight"] = mf.dtensor.Layout(["model", mf.dtensor.UNSHARDED], mesh)
        layout_map["feature.*bias"] = mf.dtensor.Layout(["model"], mesh)
    with layout_map.scope():
        model = mf.Model(SubclassedModel())
        model.compile(optimizer=mf.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])

    (x, y), _ = mf.datasets.load_digits()
    x, y = x[: args.examples].reshape(-1, 64).astype("float32"), y[: args.examples]
    ds_train = mf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=7).batch(args.global_batch)
    callbacks = [Chaos(args.kill_rank, args.kill_at, rank, args.backup_dir)]
    if args.backup_dir:
        save_freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)
        callbacks.append(mf.callbacks.BackupAndRestore(args.backup_dir, save_freq=save_freq))
    # The seed's Keras model uses logits with from_logits=True; "sparse_categorical_crossentropy" here
    # gets probabilities-free logits too, so use the explicit loss for the run.
    model.compile(optimizer=model.optimizer, loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    history = model.fit(ds_train, epochs=args.epochs, callbacks=callbacks, verbose=0)

    weights = model.get_weights()
    np.savez(os.path.join(args.out, f"weights-{rank}.npz"), **{f"w{i}": w for i, w in enumerate(weights)})
    with open(os.path.join(args.out, f"layouts-{rank}.txt"), "w") as f:
        for path, param in model.module.named_parameters():
            layout = "fully sharded" if args.fully_sharded else param.layout.to_string()
            f.write(f"{path} {type(param).__mro__[1].__name__} {layout}\n")
        f.write(f"loss {history.history['loss'][-1]:.6f}\n")


if __name__ == "__main__":
    main()
