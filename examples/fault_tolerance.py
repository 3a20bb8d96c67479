"""The TensorFlow guide "Migrate the fault tolerance mechanism", ported: four ways to survive a crash.

1. TF1 style: an Estimator whose `RunConfig` saves a checkpoint every step; a hook raises at step 5;
   a new Estimator on the same ``model_dir`` continues from the last checkpoint.
2. ``Model.fit`` with ``BackupAndRestore``: a callback raises after epoch 4; the next ``fit`` call
   continues at epoch 5 (the backup holds weights, optimizer, data position and RNG streams).
3. The same with ``save_freq=30``: interrupted mid-epoch, resumed at the step after the last backup.
4. A custom loop with ``mf.train.Checkpoint`` + ``CheckpointManager``: save each epoch, restore the
   newest at start.

Each part prints where it resumed. One process: ``python examples/fault_tolerance.py``
(``MESHFIT_EXAMPLE_TINY=1`` trains fewer steps; the test suite runs it that way).
"""

from __future__ import annotations

import os
import tempfile

import torch
from torch import nn

import meshfit as mf

TINY = os.environ.get("MESHFIT_EXAMPLE_TINY") == "1"
STEPS_PER_EPOCH = 10 if TINY else 50

(x_train, y_train), _ = mf.datasets.load_digits()  # pixels already scaled to [0, 1], labels int64


def build_module() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))


# ---- 1. Estimator: a checkpoint every step -----------------------------------------------------------

def input_fn():
    return mf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(len(x_train), seed=0).repeat().batch(32)


def model_fn(features, labels, mode):
    model = mf.estimator.once(build_module)
    optimizer = mf.estimator.once(lambda: mf.optimizers.Adam(learning_rate=0.001))
    loss = nn.functional.cross_entropy(model(features), labels)
    return mf.estimator.EstimatorSpec(mode, loss=loss, train_op=optimizer.minimize(loss))


class InterruptHook(mf.estimator.SessionRunHook):
    """Raises after the fifth step, as a crash would."""

    def begin(self):
        self._step = -1

    def before_run(self, run_context):
        self._step += 1

    def after_run(self, run_context, run_values):
        if self._step == 5:
            raise RuntimeError("Interruption")


def estimator_part(root: str) -> None:
    config = mf.estimator.RunConfig(save_checkpoints_steps=1, log_step_count_steps=None)
    model_dir = os.path.join(root, "estimator")
    try:
        mf.estimator.Estimator(model_fn, model_dir=model_dir, config=config).train(
            input_fn, hooks=[InterruptHook()], max_steps=10)
    except RuntimeError as error:
        print(f"1. Estimator interrupted: {error}")
    classifier = mf.estimator.Estimator(model_fn, model_dir=model_dir, config=config)
    print(f"1. resuming from {os.path.basename(classifier.latest_checkpoint())}")
    classifier.train(input_fn, max_steps=10)
    print(f"1. done at global step {classifier.get_variable_value('global_step')}")


# ---- 2. and 3. Model.fit with BackupAndRestore --------------------------------------------------------

def create_model() -> mf.Model:
    model = mf.Model(build_module())
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


class InterruptAtEpoch(mf.callbacks.Callback):
    def __init__(self, interrupting_epoch=3):
        super().__init__()
        self.interrupting_epoch = interrupting_epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.interrupting_epoch - 1:
            raise RuntimeError("Interruption")


class InterruptAtStep(mf.callbacks.Callback):
    def __init__(self, interrupting_step=140):
        super().__init__()
        self.total_step_count = 0
        self.interrupting_step = interrupting_step

    def on_batch_begin(self, batch, logs=None):
        self.total_step_count += 1

    def on_batch_end(self, batch, logs=None):
        if self.total_step_count == self.interrupting_step:
            raise RuntimeError("Interruption")


class ReportStart(mf.callbacks.Callback):
    def __init__(self, part):
        super().__init__()
        self.part, self.reported = part, False

    def on_train_batch_begin(self, batch, logs=None):
        if not self.reported:
            print(f"{self.part}. fit starts at epoch {self.model.loop_state.epoch + 1}, batch {batch + 1}")
            self.reported = True


def fit_part(root: str, part: int, save_freq, interrupt) -> None:
    backup_dir = os.path.join(root, f"backup-{part}")
    dataset = mf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(len(x_train), seed=0).repeat().batch(32)
    callbacks = [mf.callbacks.BackupAndRestore(backup_dir=backup_dir, save_freq=save_freq)]
    try:
        create_model().fit(dataset, epochs=5, steps_per_epoch=STEPS_PER_EPOCH, verbose=0,
                           callbacks=callbacks + [interrupt, ReportStart(part)])
    except RuntimeError as error:
        print(f"{part}. fit interrupted: {error}")
    history = create_model().fit(dataset, epochs=5, steps_per_epoch=STEPS_PER_EPOCH, verbose=0,
                                 callbacks=callbacks + [ReportStart(part)])
    losses = history.history["loss"]
    print(f"{part}. history has {len(losses)} epochs, last loss {losses[-1]:.4f}")


# ---- 4. A custom loop with Checkpoint and CheckpointManager ---------------------------------------------

def custom_loop_part(root: str) -> None:
    model = create_model()
    optimizer = mf.optimizers.Adam(learning_rate=0.001)
    optimizer.build(model.trainable_variables)
    loss_fn = mf.losses.SparseCategoricalCrossentropy(from_logits=True)
    dataset = mf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(len(x_train), seed=0).repeat().batch(32)
    iterator = iter(dataset)
    checkpoint = mf.train.Checkpoint(model=model, optimizer=optimizer, data=iterator)
    manager = mf.train.CheckpointManager(checkpoint, os.path.join(root, "custom"), max_to_keep=2)
    for epoch in range(3):
        if manager.latest_checkpoint:
            checkpoint.restore(manager.latest_checkpoint)
            print(f"4. epoch {epoch}: restored {os.path.basename(manager.latest_checkpoint)}")
        for _ in range(STEPS_PER_EPOCH):
            x, y = next(iterator)
            loss = loss_fn(y, model(x, training=True))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        manager.save()
    print(f"4. kept {[os.path.basename(path) for path in manager.checkpoints]}")


def main() -> None:
    torch.manual_seed(0)
    root = tempfile.mkdtemp(prefix="meshfit-fault-tolerance-")
    estimator_part(root)
    fit_part(root, 2, "epoch", InterruptAtEpoch(4))
    fit_part(root, 3, 30 if not TINY else 4, InterruptAtStep(140 if not TINY else 23))
    custom_loop_part(root)


if __name__ == "__main__":
    main()
