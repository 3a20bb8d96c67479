"""2-D parallelism under ``meshfit launch``: the small transformer LM of ``tests/dtensor/_two_d_model.py`` on a
``batch`` x ``model`` mesh with the guide's ``LayoutMap``, ``fit`` (with ``BackupAndRestore`` when given
``--backup-dir``); ``--kill-rank`` / ``--kill-at`` SIGKILL one worker before that optimizer step of the
first round. Writes each rank's full weights to ``<out>/weights-<rank>.npz``."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(TESTS, "dtensor"), TESTS]  # the model, and the tests' own helpers
from _interrupt import SigkillBeforeStep  # noqa: E402
from _two_d_model import BATCH, data, module, two_d_map  # noqa: E402

import meshfit as mf  # noqa: E402


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
    callbacks: list[mf.callbacks.Callback] = [SigkillBeforeStep(args.kill_rank, args.kill_at, rank)]
    if args.backup_dir:
        callbacks.append(mf.callbacks.BackupAndRestore(args.backup_dir, save_freq=5))
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, callbacks=callbacks, verbose=0)
    np.savez(os.path.join(args.out, f"weights-{rank}.npz"), **{f"w{i}": w for i, w in enumerate(model.get_weights())})


if __name__ == "__main__":
    main()
