"""Resume starts in the training loop, before any callback hook: every callback's ``on_train_begin``
sees the restored weights, optimizer step and epoch, wherever it stands in the list."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf

BACKUP_STEP, INTERRUPT_STEP = 10, 13


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")


def _model() -> mf.Model:
    torch.manual_seed(0)
    model = mf.Model(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    model.compile(optimizer=mf.optimizers.Adam(learning_rate=0.01), loss="mse")
    return model


class AtBackupStep(mf.callbacks.Callback):
    """Records the weights where the backup is taken, then interrupts a few steps later."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[np.ndarray] | None = None

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations)
        if step == BACKUP_STEP:
            self.weights = self.model.get_weights()
        if step == INTERRUPT_STEP:
            raise RuntimeError("Interruption")


class SeenAtBegin(mf.callbacks.Callback):
    """What a user callback sees when training begins."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: tuple[int, int, list[np.ndarray]] | None = None

    def on_train_begin(self, logs=None):
        self.seen = (int(self.model.optimizer.iterations), self.model.loop_state.epoch, self.model.get_weights())


@pytest.mark.parametrize("user_first", [True, False])
def test_on_train_begin_of_every_callback_sees_the_restored_state(tmp_path, user_first):
    x, y = _data()
    backup = mf.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=5, async_save=False)
    recorder = AtBackupStep()
    with pytest.raises(RuntimeError, match="Interruption"):
        _model().fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0, callbacks=[recorder, backup])
    assert recorder.weights is not None

    seen = SeenAtBegin()
    backup = mf.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=5, async_save=False)
    model = _model()
    fresh = model.get_weights()
    model.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0,
              callbacks=[seen, backup] if user_first else [backup, seen])
    assert seen.seen is not None
    iterations, epoch, weights = seen.seen
    assert (iterations, epoch) == (BACKUP_STEP, BACKUP_STEP // 8)  # 8 batches an epoch: inside epoch 1
    for restored, expected, initial in zip(weights, recorder.weights, fresh, strict=True):
        np.testing.assert_array_equal(restored, expected)
        assert not np.array_equal(restored, initial)
    assert backup.restored_from is not None and backup.restored_from.endswith("ckpt-2")


def test_two_callbacks_that_restore_are_refused_naming_both(tmp_path):
    x, y = _data()
    first = mf.callbacks.BackupAndRestore(str(tmp_path / "a"))
    second = mf.callbacks.BackupAndRestore(str(tmp_path / "b"))
    with pytest.raises(ValueError, match=r"BackupAndRestore\(backup_dir='.*a'\) and "
                                         r"BackupAndRestore\(backup_dir='.*b'\)"):
        _model().fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[first, second])


def test_a_saver_outside_the_training_loop_says_where_it_belongs(tmp_path):
    for saver in (mf.callbacks.BackupAndRestore(str(tmp_path / "c")), mf.callbacks.CheckpointSaver(str(tmp_path / "d"))):
        with pytest.raises(RuntimeError, match=r"only inside fit\(\)|use it in fit's callbacks"):
            saver.on_train_begin()
