"""LearningRateScheduler, ReduceLROnPlateau, LambdaCallback, TerminateOnNaN: Keras behaviour, exact resumes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _interrupt import InterruptAtStepEnd
from torch import nn

import meshfit as mf


def make_model(learning_rate: float = 0.05) -> mf.Model:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 10))
    model = mf.Model(module)
    model.compile(mf.optimizers.SGD(learning_rate=learning_rate, momentum=0.9),
                  mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


@pytest.fixture(scope="module")
def data():
    (x, y), _ = mf.datasets.load_digits()
    return x[:160], y[:160]


def dataset(x, y):
    return mf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=2).batch(32)


class RecordRates(mf.callbacks.Callback):
    """The learning rate of every update, from the torch optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.rates: list[float] = []

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(self.model.optimizer.torch_optimizer.param_groups[0]["lr"])


def assert_same_weights(a: mf.Model, b: mf.Model) -> None:
    for wa, wb in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_array_equal(wa, wb)


def plateau() -> mf.callbacks.ReduceLROnPlateau:
    # min_delta=10: no epoch after the first improves. Keras counts the cooldown down before it checks,
    # so cooldown=2 leaves one epoch out: the rate halves at the end of epochs 1, 3 and 5.
    return mf.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, min_delta=10.0, cooldown=2)


def test_reduce_lr_on_plateau_follows_keras_rules(data):
    x, y = data
    model = make_model()
    rates = RecordRates()
    history = model.fit(dataset(x, y), epochs=6, verbose=0, callbacks=[plateau(), rates])
    # Epoch 0 sets the best; epoch 1 waits 1 = patience -> halve; epoch 2 is cooldown; epoch 3 halves. The
    # logged rate is the one the epoch trained with.
    assert history.history["learning_rate"] == pytest.approx([0.05, 0.05, 0.025, 0.025, 0.0125, 0.0125])
    assert rates.rates[::5] == pytest.approx([0.05, 0.05, 0.025, 0.025, 0.0125, 0.0125])
    floor = mf.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.1, patience=0, min_delta=10.0, min_lr=0.001)
    history = make_model().fit(dataset(x, y), epochs=4, verbose=0, callbacks=[floor])
    assert history.history["learning_rate"] == pytest.approx([0.05, 0.05, 0.005, 0.001])  # never below min_lr
    with pytest.raises(ValueError, match=r"Invalid `factor`.*factor=1.5"):
        mf.callbacks.ReduceLROnPlateau(factor=1.5)


def test_reduce_lr_on_plateau_killed_mid_way_resumes_with_the_same_rate_bitwise(data, tmp_path):
    x, y = data
    reference = make_model()
    ref_rates = RecordRates()
    ref_history = reference.fit(dataset(x, y), epochs=6, verbose=0, callbacks=[plateau(), ref_rates])
    backup = str(tmp_path / "backup")
    # Killed at step 18 (epoch 3, batch 3): after the first reduction; the last backup is at step 16.
    with pytest.raises(RuntimeError, match="Interruption"):
        make_model().fit(dataset(x, y), epochs=6, verbose=0,
                         callbacks=[plateau(), mf.callbacks.BackupAndRestore(backup, save_freq=4), InterruptAtStepEnd(18)])
    resumed = make_model()  # a fresh model and callbacks, as after a restart
    rates = RecordRates()
    history = resumed.fit(dataset(x, y), epochs=6, verbose=0,
                          callbacks=[plateau(), mf.callbacks.BackupAndRestore(backup, save_freq=4), rates])
    assert len(rates.rates) == 30 - 16
    assert rates.rates[0] == 0.025 == ref_rates.rates[16]  # resumed with the reduced rate
    assert rates.rates == ref_rates.rates[16:]
    assert history.history == ref_history.history
    assert_same_weights(resumed, reference)


def test_learning_rate_scheduler_sets_each_epochs_rate_and_resumes_exactly(data, tmp_path):
    x, y = data

    def halve_after_first(epoch, lr):
        return lr if epoch == 0 else lr * 0.5

    reference = make_model()
    ref_rates = RecordRates()
    ref_history = reference.fit(dataset(x, y), epochs=4, verbose=0,
                                callbacks=[mf.callbacks.LearningRateScheduler(halve_after_first), ref_rates])
    assert ref_history.history["learning_rate"] == pytest.approx([0.05, 0.025, 0.0125, 0.00625])
    assert ref_rates.rates[::5] == pytest.approx([0.05, 0.025, 0.0125, 0.00625])
    backup = str(tmp_path / "backup")
    # Killed in epoch 2 after a mid-epoch backup: the resumed epoch must not be halved twice.
    with pytest.raises(RuntimeError, match="Interruption"):
        make_model().fit(dataset(x, y), epochs=4, verbose=0,
                         callbacks=[mf.callbacks.LearningRateScheduler(halve_after_first),
                                    mf.callbacks.BackupAndRestore(backup, save_freq=3), InterruptAtStepEnd(14)])
    resumed = make_model()
    rates = RecordRates()
    resumed.fit(dataset(x, y), epochs=4, verbose=0,
                callbacks=[mf.callbacks.LearningRateScheduler(halve_after_first),
                           mf.callbacks.BackupAndRestore(backup, save_freq=3), rates])
    assert rates.rates == ref_rates.rates[12:]
    assert_same_weights(resumed, reference)

    by_epoch = make_model().fit(dataset(x, y), epochs=3, verbose=0,
                                callbacks=[mf.callbacks.LearningRateScheduler(lambda epoch: 0.1 / (epoch + 1))])
    assert by_epoch.history["learning_rate"] == pytest.approx([0.1, 0.05, 0.1 / 3])
    with pytest.raises(TypeError, match="Invalid `schedule`"):
        mf.callbacks.LearningRateScheduler(0.1)


def test_lambda_callback_calls_each_function_with_keras_arguments(data):
    x, y = data
    calls: list[tuple] = []
    callback = mf.callbacks.LambdaCallback(
        on_train_begin=lambda logs: calls.append(("train_begin",)),
        on_epoch_begin=lambda epoch, logs: calls.append(("epoch_begin", epoch)),
        on_batch_end=lambda batch, logs: calls.append(("batch_end", batch, round(logs["loss"], 6))),
        on_epoch_end=lambda epoch, logs: calls.append(("epoch_end", epoch, sorted(logs))),
        on_train_end=lambda logs: calls.append(("train_end",)),
    )
    make_model().fit(dataset(x[:64], y[:64]), epochs=2, verbose=0, callbacks=[callback])
    assert [c[0] for c in calls] == ["train_begin", "epoch_begin", "batch_end", "batch_end", "epoch_end",
                                     "epoch_begin", "batch_end", "batch_end", "epoch_end", "train_end"]
    assert calls[2][1] == 0 and calls[3][1] == 1 and calls[2][2] > 0
    assert calls[4] == ("epoch_end", 0, ["accuracy", "loss"])
    # Keras 3 keeps other keywords as attributes (test_lambda_callback_with_additional_kwargs; issue 25).
    assert mf.callbacks.LambdaCallback(custom_method=print).custom_method is print
    with pytest.raises(TypeError, match="Invalid `on_epoch_end`"):
        mf.callbacks.LambdaCallback(on_epoch_end=3)


def test_lambda_callback_pickles_and_a_subclass_hook_reads_the_batch_logs(data):
    import pickle

    # Only the hooks given are the callback's own, and a callback of picklable functions pickles.
    restored = pickle.loads(pickle.dumps(mf.callbacks.LambdaCallback(on_epoch_end=print, on_train_batch_end=print)))
    assert mf.callbacks.implements_hook(restored, "on_train_batch_end")
    assert not mf.callbacks.implements_hook(restored, "on_train_batch_begin")
    # A subclass's own batch hook is a batch hook: it gets the logs, as in Keras.
    x, y = data
    seen: list[dict] = []

    class Logged(mf.callbacks.LambdaCallback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(dict(logs or {}))

    make_model().fit(x[:64], y[:64], batch_size=32, verbose=0,
                     callbacks=[Logged(on_epoch_end=lambda epoch, logs: None)])
    assert len(seen) == 2 and all("loss" in logs for logs in seen)


def test_terminate_on_nan_stops_after_the_first_bad_batch(data, capsys):
    x, y = data
    x = x[:64].copy()
    x[40] = np.nan  # in batch 1 (examples 32..63) of every epoch
    model = make_model()
    steps: list[int] = []
    terminate = mf.callbacks.TerminateOnNaN()
    history = model.fit(x, y[:64], batch_size=32, epochs=3, shuffle=False, verbose=0,
                        callbacks=[terminate, mf.callbacks.LambdaCallback(
                            on_train_batch_end=lambda batch, logs: steps.append(batch))])
    assert steps == [0, 1]  # stopped right after batch 1, whose loss is NaN
    assert terminate.terminated_at == 1
    assert model.stop_training
    assert len(history.epoch) == 1 and np.isnan(history.history["loss"][0])
    assert "Batch 1: Invalid loss, terminating training" in capsys.readouterr().out
