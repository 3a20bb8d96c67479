"""Keras 3's own callback and fit cases that an earlier port left failing, ported to meshfit.

Source: keras-team/keras at commit 3422977a5e38fb2f7709aaa9a08e47f0c43d0f60:
- keras/src/callbacks/backup_and_restore_test.py (save_freq / backup_dir errors, best case step and
  epoch, corrupted backup, model deleted at the end),
- keras/src/callbacks/model_checkpoint_test.py (case 9: "Unrecognized save_freq"),
- keras/src/callbacks/learning_rate_scheduler_test.py, reduce_lr_on_plateau_test.py
  (test_throws_when_optimizer_has_schedule),
- keras/src/trainers/data_adapters/data_adapter_utils_test.py (class_weight_to_sample_weights: every
  parametrized case, invalid / None key, not a dict), through ``fit(class_weight=...)``,
- keras/src/trainers/trainer_test.py (test_fit_with_custom_train_step, test_evaluate_with_custom_test_step,
  test_steps_per_execution_steps_per_epoch, eager mode).

Assertions are Keras's (numbers, counts, error types and words); models and tensors are translated
(``Dense(units, use_bias=False, kernel_initializer="ones")`` is ``nn.Linear(4, units, bias=False)``
filled with ones; ``CanaryLayer``'s counter is a buffer). Keras's private attributes of
BackupAndRestore read as meshfit's public equivalents (``model.loop_state`` for ``_current_epoch`` /
``_last_batch_seen``, the checkpoint folders for ``_weights_path`` / ``_prev_weights_path``).

Cases: 28 in this file (with parametrizations), all passing. One assertion differs by design and is listed in
docs/fragments/keras.md: after a step-wise interruption meshfit resumes inside the epoch (the batches
already trained on are not trained again), so the canary counts 15 forward passes where Keras 3, which
starts the interrupted epoch over, counts 17; the test asserts meshfit's 15 and says so.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf


# ---- models ---------------------------------------------------------------------------------
class Canary(nn.Module):
    """keras's CanaryLayer: counts the forward passes in a non-trainable weight (a buffer here)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("counter", torch.zeros(()))

    def forward(self, x):
        self.counter.add_(1)
        return x


def backup_model() -> mf.Model:
    torch.manual_seed(0)
    model = mf.Model(nn.Sequential(Canary(), nn.Linear(3, 1)))
    model.compile(loss="mse", optimizer="sgd", metrics=["mse"])
    return model


def counter(model: mf.Model) -> int:
    return int(model.module[0].counter.item())


class InterruptingCallback(mf.callbacks.Callback):
    def __init__(self, steps_int, epoch_int):
        super().__init__()
        self.batch_count, self.epoch_count = 0, 0
        self.steps_int, self.epoch_int = steps_int, epoch_int

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_count += 1
        if self.epoch_int is not None and self.epoch_count == self.epoch_int:
            raise RuntimeError("EpochInterruption")

    def on_batch_end(self, batch, logs=None):
        self.batch_count += 1
        if self.steps_int is not None and self.batch_count == self.steps_int:
            raise RuntimeError("StepsInterruption")


class InterruptBeforeEpoch(mf.callbacks.Callback):
    """Keras's InterruptingCallback(epoch_int=2) as meshfit orders callbacks: a saver saves after every
    other callback of the same hook, so Keras's interruption at the second epoch's end (after its save)
    is here the start of the third epoch."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("EpochInterruption")


def backups(backup_dir) -> list[str]:
    """The backups in ``backup_dir``, oldest first (meshfit keeps them as checkpoint folders)."""
    return sorted((n for n in os.listdir(backup_dir) if n.startswith("ckpt-")), key=lambda n: int(n.split("-")[1]))


def train_data():
    rng = np.random.default_rng(0)
    return rng.random((10, 3)).astype("float32"), rng.random((10, 1)).astype("float32")


# ---- backup_and_restore_test.py --------------------------------------------------------------
def test_save_freq_unknown_error():
    with pytest.raises(ValueError, match="Invalid value"):
        mf.callbacks.BackupAndRestore(backup_dir="backup_dir", save_freq="batch")
    with pytest.raises(ValueError, match="Invalid value"):
        mf.callbacks.BackupAndRestore(backup_dir="backup_dir", save_freq=0.15)


def test_backup_dir_empty_error():
    with pytest.raises(ValueError, match="Empty `backup_dir` argument passed"):
        mf.callbacks.BackupAndRestore(backup_dir="", save_freq="epoch")


def test_backup_dir_none_error():
    with pytest.raises(ValueError, match="Empty `backup_dir` argument passed"):
        mf.callbacks.BackupAndRestore(backup_dir=None, save_freq="epoch")


def test_best_case_step(tmp_path):
    backup_dir = tmp_path / "subdir"
    assert not backup_dir.exists()
    model = backup_model()
    cbk = mf.callbacks.BackupAndRestore(backup_dir, save_freq=1, async_save=False)
    x_train, y_train = train_data()
    with pytest.raises(RuntimeError):
        model.fit(x_train, y_train, batch_size=4, callbacks=[cbk, InterruptingCallback(steps_int=2, epoch_int=None)],
                  epochs=2, verbose=0)
    assert backup_dir.exists()
    assert model.loop_state.epoch == 0  # cbk._current_epoch
    assert model.loop_state.step - 1 == 1  # cbk._last_batch_seen: the index of the last batch trained
    assert counter(model) == 2

    hist = model.fit(x_train, y_train, batch_size=4, callbacks=[cbk], epochs=5, verbose=0)
    assert model.loop_state.epoch == 5
    assert hist.epoch[-1] == 4
    # Keras 3: 17 (it starts the interrupted epoch over: 2 + 5 * 3). meshfit resumes inside the epoch,
    # after the 2 batches already trained on: 5 * 3 = 15 (listed in docs/fragments/keras.md).
    assert counter(model) == 15


def test_best_case_epoch(tmp_path):
    backup_dir = tmp_path / "subdir"
    assert not backup_dir.exists()
    model = backup_model()
    assert counter(model) == 0
    cbk = mf.callbacks.BackupAndRestore(backup_dir=backup_dir, save_freq="epoch")
    x_train, y_train = train_data()
    with pytest.raises(RuntimeError):
        model.fit(x_train, y_train, batch_size=4, callbacks=[cbk, InterruptingCallback(steps_int=None, epoch_int=2)],
                  epochs=6, verbose=0)
    assert model.loop_state.epoch == 2
    assert backup_dir.exists()
    assert counter(model) == 6
    hist = model.fit(x_train, y_train, batch_size=4, callbacks=[cbk], epochs=5, verbose=0)
    assert model.loop_state.epoch == 5
    assert hist.epoch[-1] == 4
    assert counter(model) == 5 * 3


def test_backup_corrupted(tmp_path):
    backup_dir = tmp_path / "subdir"
    assert not backup_dir.exists()
    model = backup_model()
    assert counter(model) == 0
    cbk = mf.callbacks.BackupAndRestore(backup_dir=backup_dir, save_freq="epoch", double_checkpoint=True,
                                        async_save=False)
    x_train, y_train = train_data()
    with pytest.raises(RuntimeError):
        model.fit(x_train, y_train, batch_size=4, callbacks=[cbk, InterruptBeforeEpoch(2)], epochs=6, verbose=0)
    assert model.loop_state.epoch == 2
    assert backup_dir.exists()
    previous, newest = backups(backup_dir)  # _prev_weights_path and _weights_path (with their metadata)
    assert counter(model) == 6

    # Corrupt the newest backup's weights: every data file of it.
    for root, _, files in os.walk(backup_dir / newest):
        for name in files:
            if name.endswith(".distcp"):
                with open(os.path.join(root, name), "w") as f:
                    f.write("0")

    with pytest.warns(RuntimeWarning, match="Skipping the corrupt backup"):
        hist = model.fit(x_train, y_train, batch_size=4, callbacks=[cbk], epochs=5, verbose=0)
    assert cbk.restored_from == str(backup_dir / previous)  # the previous backup, epoch 1's (counter 3)
    assert model.loop_state.epoch == 5
    assert hist.epoch[-1] == 4
    assert counter(model) == 5 * 3


def test_model_deleted_case_epoch(tmp_path):
    backup_dir = tmp_path / "subdir"
    assert not backup_dir.exists()
    model = backup_model()
    cbk = mf.callbacks.BackupAndRestore(backup_dir, save_freq="epoch")
    x_train, y_train = train_data()
    model.fit(x_train, y_train, batch_size=4, callbacks=[cbk], epochs=2, verbose=0)
    assert not backup_dir.exists()


# ---- model_checkpoint_test.py, case 9 ------------------------------------------------------------
def test_model_checkpoint_unrecognized_save_freq(tmp_path):
    filepath = str(tmp_path / "checkpoint.weights.h5")
    with pytest.raises(ValueError, match="Unrecognized save_freq"):
        mf.callbacks.ModelCheckpoint(filepath, monitor="val_loss", save_best_only=True, save_weights_only=True,
                                     mode="auto", save_freq="invalid_save_freq")
    # The valid ones do not raise.
    mf.callbacks.ModelCheckpoint(filepath, monitor="val_loss", save_best_only=True, save_weights_only=True,
                                 mode="auto", save_freq="epoch")
    mf.callbacks.ModelCheckpoint(filepath, monitor="val_loss", save_best_only=True, save_weights_only=True,
                                 mode="auto", save_freq=3)


# ---- learning_rate_scheduler_test.py / reduce_lr_on_plateau_test.py ------------------------------
def schedule_model() -> mf.Model:
    torch.manual_seed(0)
    model = mf.Model(nn.Linear(3, 1))
    # Keras's PolynomialDecay(0.1, decay_steps=10); meshfit has no PolynomialDecay, any schedule is the case
    schedule = mf.optimizers.schedules.ExponentialDecay(initial_learning_rate=0.1, decay_steps=10, decay_rate=0.9)
    model.compile(loss="mse", optimizer=mf.optimizers.Adam(schedule))
    return model


def test_lr_scheduler_throws_when_optimizer_has_schedule():
    x, y = train_data()
    with pytest.raises(TypeError, match="This optimizer was created with a `LearningRateSchedule`"):
        schedule_model().fit(x, y, callbacks=[mf.callbacks.LearningRateScheduler(lambda step, lr: lr / 2)],
                             epochs=2, verbose=0)


def test_reduce_lr_throws_when_optimizer_has_schedule():
    x, y = train_data()
    reduce_lr = mf.callbacks.ReduceLROnPlateau(patience=1, factor=0.1, monitor="val_loss", min_delta=100)
    with pytest.raises(TypeError, match="This optimizer was created with a `LearningRateSchedule`"):
        schedule_model().fit(x, y, validation_data=(x, y), callbacks=[reduce_lr], epochs=2, verbose=0)


# ---- data_adapter_utils_test.py: class_weight_to_sample_weights, through fit ---------------------
class RecordWeights(mf.Model):
    """A train_step that records the sample weights fit hands it (what class_weight became)."""

    seen: list

    def train_step(self, data):
        x, y, sample_weight = mf.data.unpack_batch(data)
        self.seen.append(None if sample_weight is None else sample_weight.numpy().copy())
        return {}


def sample_weights(y, class_weight) -> np.ndarray:
    model = RecordWeights(nn.Linear(1, 1))
    model.seen = []
    model.compile("sgd", "mse")
    model.fit(np.zeros((len(y), 1), "float32"), y, batch_size=len(y), shuffle=False, class_weight=class_weight,
              verbose=0)
    (weights,) = model.seen
    return weights


@pytest.mark.parametrize("y, class_weight, expected", [
    (np.array([0, 1, 0, 2]), {0: 1.0, 1: 2.0, 2: 3.0}, np.array([1.0, 2.0, 1.0, 3.0])),  # simple_class_labels
    (np.array([[1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 1]]), {0: 1.0, 1: 2.0, 2: 3.0},
     np.array([1.0, 2.0, 1.0, 3.0])),  # one_hot_encoded_labels
    (np.array([0, 3, 0, 2]), {0: 1.0, 1: 2.0, 2: 3.0}, np.array([1.0, 1.0, 1.0, 3.0])),  # unmapped_class
    (np.array([[0], [1], [0], [2]]), {0: 1.0, 1: 2.0, 2: 3.0}, np.array([1.0, 2.0, 1.0, 3.0])),  # multi_dim
    (np.array([0, 1, 0, 2]), {}, np.array([1.0, 1.0, 1.0, 1.0])),  # all_unmapped
    (np.array([0, 1, 0, 2]), {"0": 1.0, "1": 2.0, "2": 3.0}, np.array([1.0, 2.0, 1.0, 3.0])),  # string keys
    (np.array([0, 1, 0, 2]), {0.0: 1.0, 1.0: 2.0, 2.0: 3.0}, np.array([1.0, 2.0, 1.0, 3.0])),  # float keys
], ids=["simple_class_labels", "one_hot_encoded_labels", "unmapped_class", "multi_dimensional_input",
        "all_unmapped", "string_number_keys", "float_number_keys"])
def test_class_weight_to_sample_weights(y, class_weight, expected):
    np.testing.assert_allclose(sample_weights(y, class_weight), expected)


def test_class_weight_to_sample_weights_torch_specific():
    y = torch.from_numpy(np.array([0, 1, 0, 2]))
    np.testing.assert_allclose(sample_weights(y, {0: 1.0, 1: 2.0, 2: 3.0}), np.array([1.0, 2.0, 1.0, 3.0]))
    y_one_hot = torch.from_numpy(np.array([[1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 1]]))
    np.testing.assert_allclose(sample_weights(y_one_hot, {0: 1.0, 1: 2.0, 2: 3.0}), np.array([1.0, 2.0, 1.0, 3.0]))


def test_class_weight_to_sample_weights_invalid_key():
    with pytest.raises(ValueError, match="integer keys"):
        sample_weights(np.array([0, 1, 0, 2]), {"invalid": 0.5})


def test_class_weight_to_sample_weights_non_dict():
    with pytest.raises(ValueError, match="dict-like mapping"):
        sample_weights(np.array([0, 1, 0, 2]), "not_a_dict")


def test_class_weight_to_sample_weights_none_key():
    with pytest.raises(ValueError, match="integer keys"):
        sample_weights(np.array([0, 1, 0, 2]), {None: 0.5})


# ---- trainer_test.py -------------------------------------------------------------------------------
def example_module(units: int) -> nn.Module:
    """keras's ExampleModel: Dense(units, use_bias=False, kernel_initializer=Ones())."""
    module = nn.Linear(4, units, bias=False)
    with torch.no_grad():
        module.weight.fill_(1.0)
    return module


class CustomTrainTestStepModel(mf.Model):
    def train_step(self, data):
        logs = super().train_step(data)
        logs["my_custom_metric"] = 10.0
        return logs

    def test_step(self, data):
        logs = super().test_step(data)
        logs["my_custom_metric"] = 5.0
        return logs


def custom_step_model() -> mf.Model:
    model = CustomTrainTestStepModel(example_module(3))
    model.compile(optimizer=mf.optimizers.SGD(), loss=mf.losses.MeanSquaredError(),
                  metrics=[mf.metrics.MeanSquaredError()])
    return model


def test_fit_with_custom_train_step():
    x, y = np.ones((100, 4), "float32"), np.zeros((100, 3), "float32")
    history = custom_step_model().fit(x, y, batch_size=16, verbose=0).history
    assert "loss" in history
    assert "mean_squared_error" in history
    np.testing.assert_allclose(history["my_custom_metric"], 10.0)


@pytest.mark.parametrize("return_dict", [False, True], ids=["flat", "dict"])
def test_evaluate_with_custom_test_step(return_dict):
    x, y = np.ones((100, 4), "float32"), np.zeros((100, 3), "float32")
    output = custom_step_model().evaluate(x, y, batch_size=16, return_dict=return_dict, verbose=0)
    assert len(output) == 3
    if return_dict:
        np.testing.assert_allclose(output["my_custom_metric"], 5.0)
    else:
        np.testing.assert_allclose(output[-1], 5.0)  # Custom metrics go last.


class EpochAgnosticMeanSquaredError(mf.metrics.MeanSquaredError):
    def __init__(self):
        super().__init__(name="mse")
        super().reset_state()

    def reset_state(self):
        pass  # prevent reset at each starting epoch


class StepObserver(mf.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.begin_count = self.end_count = self.epoch_begin_count = self.epoch_end_count = 0
        self.batch_loss_history = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch_begin_count += 1

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_end_count += 1

    def on_batch_begin(self, batch, logs=None):
        self.begin_count += 1

    def on_batch_end(self, batch, logs=None):
        self.end_count += 1
        self.batch_loss_history.append(logs["mse"])


def spe_model(steps_per_execution: int) -> mf.Model:
    model = mf.Model(example_module(1))
    model.compile(loss="mse", optimizer="sgd", metrics=[EpochAgnosticMeanSquaredError()],
                  steps_per_execution=steps_per_execution)
    return model


@pytest.mark.filterwarnings("ignore:Your input ran out of data")
@pytest.mark.parametrize("steps_per_epoch_test", ["match_one_epoch", "match_multi_epoch", "not_match_too_low",
                                                  "not_match_but_high_enough"])
def test_steps_per_execution_steps_per_epoch(steps_per_epoch_test):
    batch_size, epochs, steps_per_execution = 8, 2, 2
    num_batches = 5 * steps_per_execution
    data_size = num_batches * batch_size
    steps_per_epoch = {"match_one_epoch": num_batches, "match_multi_epoch": num_batches // steps_per_execution,
                       "not_match_too_low": num_batches - steps_per_execution,
                       "not_match_but_high_enough": num_batches + steps_per_execution}[steps_per_epoch_test]
    x, y = np.ones((data_size, 4), "float32"), np.ones((data_size, 1), "float32")
    model = spe_model(steps_per_execution)
    step_observer = StepObserver()
    model.fit(x=x, y=y, batch_size=batch_size, epochs=epochs, steps_per_epoch=steps_per_epoch,
              callbacks=[step_observer], verbose=0)
    if steps_per_epoch_test != "not_match_too_low":
        training_batch_count = epochs * min(steps_per_epoch, num_batches) // steps_per_execution
    else:
        complete_epochs = (num_batches // steps_per_execution) // (steps_per_epoch // steps_per_execution)
        remaining_steps = (num_batches // steps_per_execution) % (steps_per_epoch // steps_per_execution)
        steps_cycles = [complete_epochs * steps_per_epoch // steps_per_execution, remaining_steps] * epochs
        training_batch_count = sum(steps_cycles[:epochs])
    assert step_observer.begin_count == training_batch_count
    assert step_observer.end_count == step_observer.begin_count
    assert step_observer.epoch_begin_count == epochs
    assert step_observer.epoch_end_count == step_observer.epoch_begin_count

    if steps_per_epoch_test != "not_match_too_low":
        model_2 = spe_model(1)
        step_observer_2 = StepObserver()
        model_2_epochs = epochs if steps_per_epoch_test in ("not_match_but_high_enough", "match_one_epoch") else 1
        model_2.fit(x=x, y=y, batch_size=batch_size, epochs=model_2_epochs, callbacks=[step_observer_2], verbose=0)
        losses = step_observer.batch_loss_history
        losses_2 = step_observer_2.batch_loss_history[steps_per_execution - 1::steps_per_execution]
        np.testing.assert_allclose(losses, losses_2, rtol=1e-6)
        for a, b in zip(model.get_weights(), model_2.get_weights(), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6)
        np.testing.assert_allclose(model.predict(x, batch_size=batch_size, verbose=0),
                                   model_2.predict(x, batch_size=batch_size, verbose=0), rtol=1e-6)
        np.testing.assert_allclose(model.evaluate(x, y, verbose=0), model_2.evaluate(x, y, verbose=0), rtol=1e-6)
