"""2-D parallelism under ``meshfit launch``: the small transformer LM of ``tests/dtensor/_two_d_model.py`` on a
``batch`` x ``model`` mesh with the guide's ``LayoutMap``, ``fit`` (with ``BackupAndRestore`` when given
``--backup-dir``); ``--kill-rank`` / ``--kill-at`` SIGKILL one worker before that optimizer step of the
first round. Writes each rank's full weights to ``<out>/weights-<rank>.npz``."""

from __future__ import annotations

import argparse
import os
import signal
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dtensor"))
from _two_d_model import BATCH, data, module, two_d_map  # noqa: E402

import meshfit as mf  # noqa: E402


class Chaos(mf.callbacks.Callback):
    def __init__(self, kill_rank: int, kill_at: int, rank: int) -> None:
        super().__init__()
        self.kill_rank, self.kill_at, self.rank = kill_rank, kill_at, rank
        self.first_round = os.environ.get("MESHFIT_RESTART_COUNT", "0") == "0"

    def on_train_batch_begin(self, batch, logs=None):
        if self.first_round and self.rank == self.kill_rank and self.model.loop_state.iterations + 1 == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mesh", default="batch=2,model=2")
    parser.add_argument("--backup-dir", help="BackupAndRestore's folder (saving every 5 steps); none without it")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    mesh = mf.dtensor.create_mesh([(name, int(size)) for name, size in (p.split("=") for p in args.mesh.split(","))])
    rank = mesh.device_mesh.get_rank()
    with two_d_map(mf, mesh).scope():
        model = mf.Model(module())
        model.compile(optimizer=mf.optimizers.AdamW(1e-3),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data()
    callbacks: list[mf.callbacks.Callback] = [Chaos(args.kill_rank, args.kill_at, rank)]
    if args.backup_dir:
        callbacks.append(mf.callbacks.BackupAndRestore(args.backup_dir, save_freq=5))
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, callbacks=callbacks, verbose=0)
    np.savez(os.path.join(args.out, f"weights-{rank}.npz"), **{f"w{i}": w for i, w in enumerate(model.get_weights())})


if __name__ == "__main__":
    main()
