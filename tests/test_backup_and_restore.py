"""BackupAndRestore and the custom-loop checkpoint flow of the fault-tolerance seed, on one process."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
from _tamper import flip_bits
from torch import nn

import meshfit as mf


class InterruptAtEpoch(mf.callbacks.Callback):
    def __init__(self, interrupting_epoch: int = 3) -> None:
        super().__init__()
        self.interrupting_epoch = interrupting_epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.interrupting_epoch:
            raise RuntimeError("Interruption")


class InterruptAtStep(mf.callbacks.Callback):
    # The seed's callback as written there: Keras's `on_batch_begin` alias, no super().__init__().
    def __init__(self, interrupting_step: int = 140) -> None:
        self.interrupting_step = interrupting_step

    def on_batch_begin(self, batch, logs=None):
        if self.model.optimizer.iterations == self.interrupting_step:
            raise RuntimeError("Interruption")


class Recorder(mf.callbacks.Callback):
    """Where fit (re)starts: the first (epoch, batch) it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[int, int]] = []

    def on_train_batch_begin(self, batch, logs=None):
        self.batches.append((self.model.loop_state.epoch, batch))


@pytest.fixture(scope="module")
def data():
    (x, y), _ = mf.datasets.load_digits()
    return x[:320], y[:320]


def make_model() -> mf.Model:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 10))
    model = mf.Model(module)
    model.compile(mf.optimizers.Adam(learning_rate=0.01), mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def dataset(x, y, batch=32):
    return mf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=2).map(lambda a, b: (a * 1.0, b)).batch(batch)


def fit(x, y, callbacks, epochs=6, steps_per_epoch=None, repeat=False):
    model = make_model()
    ds = dataset(x, y)
    if repeat:
        ds = mf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=2).repeat().batch(32)
    history = model.fit(ds, epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0, callbacks=callbacks)
    return model, history


def assert_same_weights(a: mf.Model, b: mf.Model) -> None:
    for wa, wb in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_array_equal(wa, wb)


def test_interrupt_at_epoch_resumes_at_the_next_epoch_bitwise(data, tmp_path):
    x, y = data
    reference, ref_history = fit(x, y, [mf.callbacks.EarlyStopping(monitor="loss", patience=50)])
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="Interruption"):
        fit(x, y, [mf.callbacks.BackupAndRestore(backup), InterruptAtEpoch(3),
                   mf.callbacks.EarlyStopping(monitor="loss", patience=50)])
    assert mf.train.latest_checkpoint(backup) is not None
    recorder = Recorder()
    resumed, history = fit(x, y, [mf.callbacks.BackupAndRestore(backup), recorder,
                                  mf.callbacks.EarlyStopping(monitor="loss", patience=50)])
    # Epochs 0..2 were backed up; epoch 3 failed before it was committed and runs again.
    assert recorder.batches[0] == (3, 0)
    assert_same_weights(resumed, reference)
    assert history.history == ref_history.history  # History, metrics and the loss came back too
    assert not os.path.exists(backup)  # deleted after a successful fit


def test_interrupt_at_step_resumes_after_the_last_backup(data, tmp_path):
    # The seed: save_freq=30, failure at step 140 of 100-step epochs; the last backup is at
    # step 120 (epoch 2, step 20, 1-based), so training resumes at epoch 2, step 21.
    x, y = data
    reference, _ = fit(x, y, [], epochs=2, steps_per_epoch=100, repeat=True)
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="Interruption"):
        fit(x, y, [mf.callbacks.BackupAndRestore(backup, save_freq=30), InterruptAtStep(140)],
            epochs=2, steps_per_epoch=100, repeat=True)
    recorder = Recorder()
    resumed, _ = fit(x, y, [mf.callbacks.BackupAndRestore(backup, save_freq=30), recorder],
                     epochs=2, steps_per_epoch=100, repeat=True)
    assert recorder.batches[0] == (1, 20)  # 0-based: epoch 2, step 21
    assert len(recorder.batches) == 80
    assert_same_weights(resumed, reference)


def test_async_backups_give_the_same_result(data, tmp_path):
    x, y = data
    reference, _ = fit(x, y, [], epochs=3)
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="Interruption"):
        fit(x, y, [mf.callbacks.BackupAndRestore(backup, save_freq=4, async_save=True), InterruptAtStep(23)], epochs=3)
    resumed, _ = fit(x, y, [mf.callbacks.BackupAndRestore(backup, save_freq=4, async_save=True)], epochs=3)
    assert_same_weights(resumed, reference)


def test_early_stopping_counters_survive_a_restart(data, tmp_path):
    x, y = data
    backup = str(tmp_path / "backup")
    stop = mf.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=10.0)
    with pytest.raises(RuntimeError, match="Interruption"):
        fit(x, y, [mf.callbacks.BackupAndRestore(backup), InterruptAtEpoch(0), stop])
    # Epoch 0 set the baseline; a fresh EarlyStopping restored from the backup stops after epoch 1.
    again = mf.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=10.0)
    _, history = fit(x, y, [mf.callbacks.BackupAndRestore(backup), again])
    assert history.epoch == [0, 1]
    assert again.stopped_epoch == 1


def test_keep_the_backup_and_bad_arguments(data, tmp_path):
    x, y = data
    backup = str(tmp_path / "kept")
    fit(x, y, [mf.callbacks.BackupAndRestore(backup, delete_checkpoint=False)], epochs=1)
    assert mf.train.latest_checkpoint(backup) is not None
    with pytest.raises(ValueError, match="save_freq=-1"):
        mf.callbacks.BackupAndRestore(backup, save_freq=-1)
    with pytest.raises(ValueError, match="save_freq='batch'"):
        mf.callbacks.BackupAndRestore(backup, save_freq="batch")


def test_custom_loop_with_checkpoint_manager(tmp_path):
    # The seed's custom training loop: Checkpoint(model, optimizer) + CheckpointManager(max_to_keep).
    torch.manual_seed(0)
    (x, y), _ = mf.datasets.load_digits()
    x, y = torch.from_numpy(x[:128]).flatten(1), torch.from_numpy(y[:128])

    def build():
        torch.manual_seed(0)
        module = nn.Linear(64, 10)
        return module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)

    def train_epoch(module, optimizer):
        for i in range(0, 128, 32):
            optimizer.zero_grad()
            nn.functional.cross_entropy(module(x[i:i + 32]), y[i:i + 32]).backward()
            optimizer.step()

    reference, ref_opt = build()
    for _ in range(4):
        train_epoch(reference, ref_opt)

    module, optimizer = build()
    epoch = torch.tensor(0)
    checkpoint = mf.train.Checkpoint(model=module, optimizer=optimizer, epoch=epoch)
    manager = mf.train.CheckpointManager(checkpoint, str(tmp_path / "ckpts"), max_to_keep=2)
    for _ in range(3):
        train_epoch(module, optimizer)
        epoch += 1
        manager.save()
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-2", "ckpt-3"]

    # A new process: rebuild, restore the latest, continue.
    module, optimizer = build()
    epoch = torch.tensor(0)
    checkpoint = mf.train.Checkpoint(model=module, optimizer=optimizer, epoch=epoch)
    latest = mf.train.latest_checkpoint(str(tmp_path / "ckpts"))
    assert latest.endswith("ckpt-3")
    checkpoint.restore(latest)
    assert int(epoch) == 3
    train_epoch(module, optimizer)
    for a, b in zip(module.state_dict().values(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(FileNotFoundError, match="ckpt-9"):
        checkpoint.restore(str(tmp_path / "ckpts" / "ckpt-9"))


def test_resume_from_a_backup_at_an_epochs_last_step_keeps_that_epochs_logs(data, tmp_path):
    x, y = data
    _, reference = fit(x, y, [], epochs=3, steps_per_epoch=4, repeat=True)
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="Interruption"):
        fit(x, y, [mf.callbacks.BackupAndRestore(backup, save_freq=4), InterruptAtStep(5)],
            epochs=3, steps_per_epoch=4, repeat=True)
    _, history = fit(x, y, [mf.callbacks.BackupAndRestore(backup, save_freq=4)], epochs=3, steps_per_epoch=4,
                     repeat=True)
    assert history.history == reference.history


def test_keras_batch_aliases_are_called(data):
    # on_batch_begin / on_batch_end are Keras's aliases of the train-batch hooks: the seed's
    # InterruptAtStep relies on them (a callback overriding them was silently never called).
    x, y = data
    seen = []

    class Aliases(mf.callbacks.Callback):
        def on_batch_begin(self, batch, logs=None):
            seen.append(("begin", batch))

        def on_batch_end(self, batch, logs=None):
            seen.append(("end", batch, "loss" in logs))

    fit(x, y, [Aliases()], epochs=1, steps_per_epoch=2, repeat=True)
    assert seen == [("begin", 0), ("end", 0, True), ("begin", 1), ("end", 1, True)]
    with pytest.raises(RuntimeError, match="Interruption"):
        fit(x, y, [InterruptAtStep(3)], epochs=1, steps_per_epoch=5, repeat=True)


def _array_model() -> mf.Model:
    module = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 10))
    model = mf.Model(module)
    model.compile(mf.optimizers.Adam(learning_rate=0.01), mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def test_same_seed_same_fit_on_arrays_in_one_process(data):
    # Item 5: the shuffle of array input derives from torch's RNG when fit starts, not from a
    # per-process counter: the same seed gives the same run, first call or second.
    x, y = data
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = _array_model()
        model.fit(x, y, batch_size=32, epochs=2, verbose=0)
        runs.append(model)
    assert_same_weights(runs[0], runs[1])


def test_backup_resumed_mid_epoch_in_the_same_process_on_arrays_is_bitwise(data, tmp_path):
    # The fault-tolerance seed's notebook flow: fit raises; a new model (no reseeding) calls fit
    # again in the same process and resumes from the step backup with the order it saved.
    x, y = data
    torch.manual_seed(0)
    reference = _array_model()
    ref_history = reference.fit(x, y, batch_size=32, epochs=3, verbose=0)
    backup = str(tmp_path / "backup")
    torch.manual_seed(0)
    model = _array_model()
    with pytest.raises(RuntimeError, match="Interruption"):
        model.fit(x, y, batch_size=32, epochs=3, verbose=0,
                  callbacks=[mf.callbacks.BackupAndRestore(backup, save_freq=4), InterruptAtStep(14)])
    recorder = Recorder()
    model = _array_model()
    history = model.fit(x, y, batch_size=32, epochs=3, verbose=0,
                        callbacks=[mf.callbacks.BackupAndRestore(backup, save_freq=4), recorder])
    assert recorder.batches[0] == (1, 2)  # iteration 12 = epoch 2, batch 3 (1-based)
    assert_same_weights(model, reference)
    assert history.history == ref_history.history


def test_delete_checkpoint_deletes_only_what_meshfit_wrote(data, tmp_path):
    x, y = data
    backup = tmp_path / "backup"
    with pytest.raises(RuntimeError, match="Interruption"):
        fit(x, y, [mf.callbacks.BackupAndRestore(str(backup), save_freq=4), InterruptAtStep(6)], epochs=1)
    (backup / "notes.txt").write_text("the user's own file")  # added to a meshfit backup folder later
    fit(x, y, [mf.callbacks.BackupAndRestore(str(backup))], epochs=1)
    assert sorted(os.listdir(backup)) == ["notes.txt"]  # backups, record and marker gone; the user's file kept


def test_a_finished_backup_folder_is_gone_when_fit_returns_and_a_killed_deleters_leftover_is_removed(data, tmp_path):
    x, y = data
    backup = tmp_path / "backup"
    fit(x, y, [mf.callbacks.BackupAndRestore(str(backup), save_freq=4)], epochs=1)
    assert not backup.exists()  # renamed away before fit returned: no later run can resume from it
    for thread in [t for t in threading.enumerate() if t.name == "meshfit-prune"]:
        thread.join(timeout=30)  # the files are unlinked on a thread
    assert sorted(os.listdir(tmp_path)) == []
    # A process killed while unlinking leaves `<folder>.deleting-<pid>`: claiming the folder again removes it,
    # also when this process has the killed one's pid (a restarted container often does)
    for pid in (999999999, os.getpid()):
        dead = tmp_path / f"backup.deleting-{pid}"
        (dead / "ckpt-1").mkdir(parents=True)
        (dead / "ckpt-1" / "data").write_bytes(b"x" * 100)
    with pytest.raises(RuntimeError, match="Interruption"):
        fit(x, y, [mf.callbacks.BackupAndRestore(str(backup), save_freq=4, async_save=False), InterruptAtStep(6)],
            epochs=1)
    assert sorted(os.listdir(tmp_path)) == ["backup"]
    assert "ckpt-1" in os.listdir(backup)  # this run's backup (step 4) is kept until its fit completes


def test_a_non_empty_folder_that_is_not_a_backup_is_refused(data, tmp_path):
    x, y = data
    folder = tmp_path / "results"
    folder.mkdir()
    for name in ("a.csv", "b.png", "model.pt"):
        (folder / name).write_text(name)
    with pytest.raises(ValueError, match=r"results.*not a meshfit backup folder.*a\.csv"):
        fit(x, y, [mf.callbacks.BackupAndRestore(str(folder))], epochs=1)
    assert sorted(os.listdir(folder)) == ["a.csv", "b.png", "model.pt"]
    with pytest.raises(TypeError, match=r"Invalid `backup_dir`.*backup_dir=5"):
        mf.callbacks.BackupAndRestore(backup_dir=5)


def test_a_corrupt_latest_backup_falls_back_to_the_previous_one(data, tmp_path):
    x, y = data
    backup = tmp_path / "backup"
    reference, _ = fit(x, y, [], epochs=1)
    with pytest.raises(RuntimeError, match="Interruption"):
        # synchronous: the backup of step 6 is complete when the interruption at step 7 ends fit
        fit(x, y, [mf.callbacks.BackupAndRestore(str(backup), save_freq=2, async_save=False), InterruptAtStep(7)],
            epochs=1)
    latest = mf.train.latest_checkpoint(backup)
    assert latest.endswith("ckpt-3")
    data_file = os.path.join(latest, "__0_0.distcp")
    flip_bits(data_file)
    recorder = Recorder()
    callback = mf.callbacks.BackupAndRestore(str(backup), save_freq=2, delete_checkpoint=False)
    with pytest.warns(RuntimeWarning, match=r"Skipping the corrupt backup .*ckpt-3.*__0_0\.distcp"):
        resumed, _ = fit(x, y, [callback, recorder], epochs=1)
    assert callback.restored_from.endswith("ckpt-2")
    assert recorder.batches[0] == (0, 4)  # resumed after the backup at iteration 4
    assert_same_weights(resumed, reference)
