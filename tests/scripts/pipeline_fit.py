"""Pipeline parallelism under ``meshfit launch``: the classifier of ``tests/dtensor/_pipeline_model.py`` split at
``blocks.2`` on a ``pipe`` mesh (``--mesh``; with ``--sharded`` each stage is fully sharded over the mesh's data
axis), ``fit`` for 2 epochs of 8 steps (with ``BackupAndRestore`` every 3 steps when given ``--backup-dir``);
``--kill-rank`` / ``--kill-at`` SIGKILL one worker before that optimizer step of the first round, printing
``rank R: SIGKILL at <time>``; ``--term-rank`` / ``--term-at`` send it SIGTERM there instead (a preemption). Writes each rank's full weights (``get_weights``: every stage's) to
``<out>/weights-<rank>.npz``."""

from __future__ import annotations

import argparse
import os
import signal
import sys

import numpy as np

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(TESTS, "dtensor"), TESTS]  # the model, and the tests' own helpers
from _interrupt import SigkillBeforeStep  # noqa: E402
from _pipeline_model import Classifier, compile_model, data  # noqa: E402

import meshfit as mf  # noqa: E402


class SigtermBeforeStep(mf.callbacks.Callback):
    """SIGTERM (a preemption) this process, when it is rank ``term_rank``, before optimizer step ``term_at`` of a
    launched job's first round."""

    def __init__(self, term_rank: int, term_at: int, rank: int) -> None:
        super().__init__()
        self.term_rank, self.term_at, self.rank = term_rank, term_at, rank
        self.first_round = os.environ.get("MESHFIT_RESTART_COUNT", "0") == "0"

    def on_train_batch_begin(self, batch, logs=None):
        if self.first_round and self.rank == self.term_rank and self.model.loop_state.iterations + 1 == self.term_at:
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mesh", default="pipe=2")
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--sharded", action="store_true", help="stages fully sharded over the data axis")
    parser.add_argument("--backup-dir")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--term-rank", type=int, default=-1)
    parser.add_argument("--term-at", type=int, default=-1)
    parser.add_argument("--local", action="store_true", help="a plain script: the first process starts the others")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dims = [(name, int(size)) for name, size in (p.split("=") for p in args.mesh.split(","))]
    size = int(np.prod([d for _, d in dims]))
    mesh = mf.dtensor.create_mesh(dims, devices=[f"cpu:{i}" for i in range(size)] if args.local else None)
    rank = mesh.device_mesh.get_rank()
    layout_map = mf.dtensor.LayoutMap.fully_sharded(mesh) if args.sharded else mf.dtensor.LayoutMap(mesh)
    layout_map = layout_map.pipeline(["blocks.2"], microbatches=2, schedule=args.schedule)
    with layout_map.scope():
        model = mf.Model(Classifier())
    compile_model(mf, model)
    x, y = data()
    callbacks: list[mf.callbacks.Callback] = [SigkillBeforeStep(args.kill_rank, args.kill_at, rank),
                                              SigtermBeforeStep(args.term_rank, args.term_at, rank)]
    if args.backup_dir:
        callbacks.append(mf.callbacks.BackupAndRestore(args.backup_dir, save_freq=3))
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, callbacks=callbacks, verbose=0)
    np.savez(os.path.join(args.out, f"weights-{rank}.npz"), **{f"w{i}": w for i, w in enumerate(model.get_weights())})


if __name__ == "__main__":
    main()
