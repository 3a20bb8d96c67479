"""A worker script for the multi-process tests: the seed tutorial's flow on bundled digits.

Run by the tests under TF_CONFIG, `meshfit launch`, or as a plain script with MirroredStrategy.
Writes each rank's final weights to ``<out>/weights-<rank>.npz`` and, with --record, the ids of the
examples each rank trained on to ``<out>/seen-<rank>-<restart>.txt``.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import signal
import threading
import time

import numpy as np
import torch
from torch import nn

import meshfit as mf


def build_module(dropout: float = 0.1, batchnorm: bool = False) -> nn.Module:
    norm = [nn.BatchNorm1d(32)] if batchnorm else []
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), *norm, nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 10))


class Chaos(mf.callbacks.Callback):
    """Test hooks: kill (SIGKILL) or preempt (SIGTERM) this process at a step."""

    def __init__(self, args, rank: int) -> None:
        super().__init__()
        self.args, self.rank = args, rank
        self.first_round = os.environ.get("MESHFIT_RESTART_COUNT", "0") == "0"
        self.backup = None  # the run's BackupAndRestore, if any

    def on_train_batch_begin(self, batch, logs=None):
        step = self.model.loop_state.iterations + 1
        if self.first_round and self.args.kill_rank == self.rank and step == self.args.kill_at:
            if self.backup is not None:
                # BackupAndRestore saves in the background by default: let the backup in flight land, so
                # the kill follows a complete one as with synchronous saves (a kill inside a save is the
                # --kill-end-rank trials' and the checkpoint chaos tests' case).
                self.backup.wait()
            with open(os.path.join(self.args.out, "killed-at.txt"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if self.first_round and self.args.term_rank == self.rank and step == self.args.term_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if self.first_round and self.rank == 0 and step == self.args.mark_at:
            with open(os.path.join(self.args.out, "reached.txt"), "w") as f:
                f.write(repr(time.time()))
        if self.first_round and self.args.freeze_rank == self.rank and step == self.args.freeze_at:
            with open(os.path.join(self.args.out, "frozen-at.txt"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen: alive but silent, as a hung host

    def on_train_batch_end(self, batch, logs=None):
        step = self.model.loop_state.iterations
        if self.first_round and self.args.kill_end_rank == self.rank and step == self.args.kill_end_at:
            with open(os.path.join(self.args.out, "killed-at.txt"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)  # after the step's collectives, before the backup's
        if self.args.sleep:
            time.sleep(self.args.sleep)


class RecordingModel(mf.Model):
    """Writes the ids (last feature column) of every example this replica trains on."""

    record = None

    def train_step(self, data):
        super().train_step(data[:2])
        if self.record is not None:  # "iteration: ids" of the examples this step trained on
            ids = " ".join(str(int(i)) for i in data[2].tolist())
            self.record.write(f"{self.loop_state.iterations + 1}: {ids}\n")
            self.record.flush()


def run_evaluator(args) -> None:
    """The evaluator task: evaluate each checkpoint the workers save, then report them."""
    (_, _), (x_test, y_test) = mf.datasets.load_digits()
    model = mf.Model(build_module())
    model.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    evaluator = mf.SidecarEvaluator(model, (x_test, y_test), args.checkpoint_dir,
                                    max_evaluations=args.epochs, timeout=15, poll_interval=0.1)
    results = evaluator.start()
    print("evaluated " + " ".join(os.path.basename(path) for path, _ in results), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="multiworker", choices=["multiworker", "mirrored", "one"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument("--backup-dir", default=None)
    parser.add_argument("--save-freq", default="epoch")
    # BackupAndRestore's default (asynchronous) unless one of these is given
    parser.add_argument("--async-save", dest="async_save", action="store_const", const=True, default=None)
    parser.add_argument("--sync-save", dest="async_save", action="store_const", const=False)
    parser.add_argument("--keep-backup", action="store_true")
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--term-rank", type=int, default=-1)
    parser.add_argument("--term-at", type=int, default=-1)
    parser.add_argument("--kill-end-rank", type=int, default=-1, help="SIGKILL at the end of a step, "
                        "before BackupAndRestore saves it")
    parser.add_argument("--kill-end-at", type=int, default=-1)
    parser.add_argument("--mark-at", type=int, default=-1, help="rank 0 writes reached.txt at this step")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--batchnorm", action="store_true", help="a BatchNorm1d after the first layer")
    parser.add_argument("--freeze-rank", type=int, default=-1)
    parser.add_argument("--freeze-at", type=int, default=-1)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--heartbeat", type=float, default=4.0)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--report-threads", action="store_true",
                        help="print the meshfit threads still alive after every other exit handler")
    args = parser.parse_args()
    if args.report_threads:  # registered first, so it runs last
        frozen_at_start = gc.get_freeze_count()  # a warm or preloaded process starts with its server's
        atexit.register(lambda: print("meshfit threads at exit: " + repr(sorted(
            t.name for t in threading.enumerate() if t.name.startswith("meshfit-")))
            + f"; objects frozen: {gc.get_freeze_count() > frozen_at_start}", flush=True))
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    options = mf.CommunicationOptions(heartbeat_timeout_seconds=args.heartbeat)
    if args.strategy == "mirrored":
        strategy = mf.MirroredStrategy(devices=["cpu:0", "cpu:1"], communication_options=options)
    elif args.strategy == "multiworker":
        strategy = mf.MultiWorkerMirroredStrategy(communication_options=options)
    else:
        strategy = mf.OneDeviceStrategy("cpu")
    rank = strategy.replica_id
    resolver = strategy.cluster_resolver
    if resolver.task_type == "evaluator":
        run_evaluator(args)
        return
    (x, y), _ = mf.datasets.load_digits()
    x, y = x[: args.examples], y[: args.examples]
    ids = np.arange(len(x), dtype=np.int64)
    dataset = (mf.data.Dataset.from_tensor_slices((x, y, ids)).shuffle(len(x), seed=7)
               .repeat().batch(args.global_batch).prefetch(2))
    steps = args.steps or len(x) // args.global_batch
    with strategy.scope():
        model = RecordingModel(build_module(args.dropout, args.batchnorm))
        model.compile(mf.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    if args.record:
        restart = os.environ.get("MESHFIT_RESTART_COUNT", "0")
        model.record = open(os.path.join(args.out, f"seen-{rank}-{restart}.txt"), "a")
    chaos = Chaos(args, rank)
    callbacks = [chaos]
    if args.backup_dir:
        save_freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)
        chaos.backup = mf.callbacks.BackupAndRestore(args.backup_dir, save_freq=save_freq,
                                                     delete_checkpoint=not args.keep_backup,
                                                     **({} if args.async_save is None
                                                        else {"async_save": args.async_save}))
        callbacks.insert(1 if args.kill_end_rank >= 0 else 0, chaos.backup)
    if args.checkpoint_dir:
        callbacks.append(mf.callbacks.ModelCheckpoint(os.path.join(args.checkpoint_dir, "ckpt-{epoch}")))
    model.fit(dataset, epochs=args.epochs, steps_per_epoch=steps, callbacks=callbacks, verbose=2)
    weights = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    np.savez(os.path.join(args.out, f"weights-{rank}.npz"), **weights)
    print(f"rank {rank} of {strategy.num_replicas_in_sync} done (task {resolver.task_type} {resolver.task_id}, "
          f"chief {resolver.is_chief})", flush=True)


if __name__ == "__main__":
    main()
