"""The main job behind ``meshfit demo``: the seed tutorial's ``main.py``, ported to meshfit.

Started by ``meshfit launch`` (each worker gets ``TF_CONFIG``): the seed CNN trained on scikit-learn's
bundled digits resized to 28x28, with the global batch split across workers, a progress bar on the
chief, and ``BackupAndRestore`` so that a killed worker's group resumes exactly where it stopped.

Fault tolerance is shown, not only claimed: the chief says each time a backup is written; in the
first round one worker crashes on purpose at ``--crash-at-step`` (0 turns it off), the launcher
restarts the group, and the chief says where training resumed. At the end the chief saves the model
as ``<output-dir>/model.keras`` and draws the loss and accuracy curves in ``<output-dir>/training.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
from torch import nn

import meshfit as mf
from meshfit.callbacks import supports_redraw


def build_and_compile_cnn_model() -> mf.Model:
    module = nn.Sequential(nn.Unflatten(1, (1, 28)), nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Flatten(),
                           nn.LazyLinear(128), nn.ReLU(), nn.Linear(128, 10))
    model = mf.Model(module)
    model.compile(optimizer=mf.optimizers.SGD(learning_rate=0.05, momentum=0.9),
                  loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


class ShowBackups(mf.callbacks.Callback):
    """Prints (on the chief) each backup `BackupAndRestore` has just written; runs after it."""

    run_last = True
    reads_batch_logs = False

    def __init__(self, backup_dir: str) -> None:
        super().__init__()
        self.backup_dir = backup_dir
        self._latest: str | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._latest = mf.train.latest_checkpoint(self.backup_dir)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._report()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._report()

    def _report(self) -> None:
        if not self._require_model().strategy.is_chief:
            return
        latest = mf.train.latest_checkpoint(self.backup_dir)
        if latest is not None and latest != self._latest:
            self._latest = latest
            counters = self._require_loop().counters
            newline = "\n" if supports_redraw(sys.stdout) else ""  # a live bar may be mid-line
            print(f"{newline}backup written at step {counters.iterations} (epoch {counters.epoch + 1}, batch "
                  f"{counters.step}): {latest}", flush=True)


class CrashOnce(mf.callbacks.Callback):
    """Ends this worker abruptly at a given step, as a machine failure would (first round only)."""

    reads_batch_logs = False

    def __init__(self, step: int, worker: int) -> None:
        super().__init__()
        self.step, self.worker = step, worker

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._require_loop().counters.iterations == self.step:
            print(f"worker {self.worker}: simulating a crash at step {self.step} "
                  "(meshfit demo --crash-at-step 0 turns this off)", flush=True)
            os._exit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=None)
    parser.add_argument("--backup-dir", default=None)
    parser.add_argument("--save-freq", type=int, default=10, help="steps between backups")
    parser.add_argument("--crash-at-step", type=int, default=0, help="one worker fails at this step (first round)")
    parser.add_argument("--output-dir", default="meshfit-demo", help="where model.keras and training.png go")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    tf_config = json.loads(os.environ.get("TF_CONFIG", '{"cluster": {"worker": ["localhost:0"]}}'))
    num_workers = len(tf_config["cluster"]["worker"])
    strategy = mf.MultiWorkerMirroredStrategy()
    (x_train, y_train), (x_test, y_test) = mf.datasets.load_digits(image_size=28)
    per_worker_batch = 32
    dataset = (mf.data.Dataset.from_tensor_slices((x_train, y_train))
               .shuffle(len(x_train), seed=0).repeat().batch(per_worker_batch * num_workers).prefetch())
    steps = args.steps_per_epoch or len(x_train) // (per_worker_batch * num_workers)
    with strategy.scope():
        model = build_and_compile_cnn_model()
    backup_dir = args.backup_dir or os.path.join(tempfile.gettempdir(), "meshfit-demo-backup")
    # Synchronous saves: the demo shows each backup as it lands, at the step it holds (the default
    # async write lands a few steps later; the resume is exact either way).
    callbacks = [mf.callbacks.BackupAndRestore(backup_dir=backup_dir, save_freq=args.save_freq, async_save=False),
                 ShowBackups(backup_dir)]
    task = tf_config.get("task", {})
    crash_worker = num_workers - 1
    first_round = os.environ.get("MESHFIT_RESTART_COUNT", "0") == "0"
    if args.crash_at_step > 0 and first_round and task.get("index", 0) == crash_worker:
        callbacks.append(CrashOnce(args.crash_at_step, crash_worker))
    history = model.fit(dataset, epochs=args.epochs, steps_per_epoch=steps, callbacks=callbacks,
                        validation_data=(x_test, y_test), validation_batch_size=128)
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=128, verbose=0)
    output_dir = os.path.abspath(args.output_dir)
    model.save(os.path.join(output_dir, "model.keras"))  # every worker calls it; the chief writes
    if strategy.is_chief:
        picture = mf.utils.plot_history(history, os.path.join(output_dir, "training.png"),
                                        title=f"seed CNN on digits, {strategy.num_replicas_in_sync} workers")
        print(f"test accuracy: {accuracy:.4f} (loss {loss:.4f}) on {len(x_test)} held-out digits, "
              f"{strategy.num_replicas_in_sync} workers")
        print(f"model saved to {os.path.join(output_dir, 'model.keras')}")
        print(f"training curves (loss and accuracy per epoch) drawn in {picture}")


if __name__ == "__main__":
    main()
