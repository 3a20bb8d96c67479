"""Worker script for bench_backup.py part B, run by ``meshfit launch --workers 2 --max-restarts 1``.

Trains the seed CNN (global batch 128) with ``BackupAndRestore(save_freq=10)``. In round 0
(``MESHFIT_RESTART_COUNT=0``) worker ``--kill-rank`` writes ``time.time()`` to ``kill-time`` and
SIGKILLs itself before step ``--kill-at``; the launcher restarts the group and round 1 resumes from
the last backup. Every process appends timestamped events to ``<events>/events-<rank>-<round>.jsonl``
(script start, imports done, strategy ready, model ready, fit called, before/after the restore in
``on_train_begin``, first ``on_train_batch_end``) and prints ``FIRST_STEP <time>`` at its first
``on_train_batch_end``.
"""

from __future__ import annotations

import time

T_SCRIPT = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

# meshfit launch's restart count, or torchrun's
ROUND = int(os.environ.get("MESHFIT_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


class Events:
    def __init__(self, directory: str, rank: str) -> None:
        self.path = os.path.join(directory, f"events-{rank}-{ROUND}.jsonl")

    def __call__(self, name: str, t: float | None = None, **extra: object) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"event": name, "t": time.time() if t is None else t, **extra}) + "\n")
            f.flush()
            os.fsync(f.fileno())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", required=True)
    parser.add_argument("--backup-dir", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-freq", type=int, default=10)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-at", type=int, default=25)
    parser.add_argument("--step-delay", type=float, default=0.0,
                        help="seconds every worker sleeps before each step (simulates a slower model)")
    args = parser.parse_args()
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
    events = Events(args.events, str(task.get("index", os.environ.get("RANK", "x"))))
    events("script_start", T_SCRIPT, pid=os.getpid())

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _common as C
    import torch

    import meshfit as mf

    events("imports_done")
    C.quiet_threads()
    torch.manual_seed(0)
    strategy = mf.MultiWorkerMirroredStrategy()
    rank = strategy.replica_id
    events("strategy_ready", rank=rank)
    x, y = C.load_train()
    dataset = (mf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0).repeat()
               .batch(64 * strategy.num_replicas_in_sync))
    with strategy.scope():
        model = mf.Model(C.seed_module())
        C.compile_seed(model)
    events("model_ready")

    class TimedBackupAndRestore(mf.callbacks.BackupAndRestore):
        """BackupAndRestore with its restore (``on_train_begin``) bracketed by events."""

        def on_train_begin(self, logs=None):
            events("restore_begin")
            super().on_train_begin(logs)
            events("restore_end", iterations=self.model.loop_state.iterations, restored_from=self.restored_from)

    class Probe(mf.callbacks.Callback):
        first = True

        def on_train_batch_begin(self, batch, logs=None):
            step = self.model.loop_state.iterations + 1
            if ROUND == 0 and rank == args.kill_rank and step == args.kill_at:
                now = time.time()
                with open(os.path.join(args.events, "kill-time"), "w") as f:
                    f.write(f"{now!r}\n")
                    f.flush()
                    os.fsync(f.fileno())
                os.kill(os.getpid(), signal.SIGKILL)
            if args.step_delay:  # after the kill: the survivor is busy, not in a collective, when it comes
                time.sleep(args.step_delay)

        def on_train_batch_end(self, batch, logs=None):
            if self.first:
                self.first = False
                now = time.time()
                events("first_batch_end", now, iterations=self.model.loop_state.iterations)
                print(f"FIRST_STEP {now!r} round {ROUND} rank {rank} iteration "
                      f"{self.model.loop_state.iterations}", flush=True)

    callbacks = [TimedBackupAndRestore(args.backup_dir, save_freq=args.save_freq), Probe()]
    events("fit_called")
    try:
        model.fit(dataset, epochs=1, steps_per_epoch=args.steps, callbacks=callbacks, verbose=0)
    except BaseException as error:
        events("fit_raised", error=f"{type(error).__name__}: {str(error)[:300]}")
        raise
    events("done")


if __name__ == "__main__":
    main()
