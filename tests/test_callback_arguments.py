"""Callback arguments as Keras 3 handles them (issue 25, point 9), from ``keras/src/callbacks/*_test.py``
and ``monitor_callback.py``: the "auto" direction, unknown modes, ``best``'s start, ``save_best_only``
without the monitored value, LambdaCallback's extra keywords, ``BackupAndRestore``'s empty folder."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf
from meshfit.callbacks import (
    BackupAndRestore,
    EarlyStopping,
    LambdaCallback,
    ModelCheckpoint,
    ReduceLROnPlateau,
)


def make_model(metrics=("accuracy",)) -> mf.Model:
    torch.manual_seed(0)
    model = mf.Model(nn.Linear(4, 3))
    model.compile(mf.optimizers.SGD(learning_rate=0.05), mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=list(metrics))
    return model


X = np.random.default_rng(0).normal(size=(20, 4)).astype("f4")
Y = np.arange(20) % 3


def fit(model: mf.Model, callbacks, epochs: int = 2, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "conditioned on metric ... which is not available"
        return model.fit(X, Y, batch_size=5, epochs=epochs, validation_data=(X, Y), callbacks=callbacks,
                         verbose=0, **kwargs)


@pytest.mark.parametrize("mode, monitor, expected", [
    # Keras's test_early_stopping cases.
    ("max", "val_mse", np.greater), ("min", "val_loss", np.less), ("auto", "val_mse", np.less),
    ("auto", "loss", np.less), ("auto", "acc", np.greater), ("auto", "val_accuracy", np.greater),
    ("auto", "hinge", np.less), ("auto", "f1_score", np.greater),
])
def test_early_stopping_direction_as_keras(mode, monitor, expected):
    callback = EarlyStopping(patience=0, monitor=monitor, mode=mode)
    fit(make_model(), [callback])
    assert callback.monitor_op is expected


@pytest.mark.parametrize("cls", [EarlyStopping, ReduceLROnPlateau,
                                 lambda monitor: ModelCheckpoint("m.keras", monitor=monitor, save_best_only=True)])
def test_an_unknown_monitor_in_auto_mode_raises_when_fit_starts(cls, tmp_path):
    callback = cls(monitor="unknown")
    model = make_model()
    with pytest.raises(ValueError, match=r"Invalid `monitor` for \w+: in mode='auto' the direction of "
                                         r"monitor='unknown' cannot be told.*Pass mode='max'.*mode='min'"):
        fit(model, [callback])
    # Told at on_train_begin, before a step is spent (Keras raises at the first epoch's end).
    assert model.optimizer.iterations == 0
    cls(monitor="unknown_metric_a")  # construction alone does not raise: the model's metrics may tell


def test_auto_mode_reads_the_direction_of_compiled_metrics():
    torchmetrics = pytest.importorskip("torchmetrics")
    # Names no rule knows: only the metrics' own higher_is_better tells.
    higher = torchmetrics.classification.MulticlassCohenKappa(num_classes=3)
    lower = torchmetrics.classification.MulticlassHammingDistance(num_classes=3)
    model = make_model(metrics=[higher, lower])
    names = [m.name for m in model.metrics[1:]]
    assert names == ["multiclass_cohen_kappa", "multiclass_hamming_distance"]
    up, down = EarlyStopping(monitor=f"val_{names[0]}"), EarlyStopping(monitor=names[1])
    assert up.monitor_op is None and down.monitor_op is None  # told from the model when fit starts
    fit(model, [up, down])
    assert up.monitor_op is np.greater and down.monitor_op is np.less


@pytest.mark.parametrize("cls", [EarlyStopping, ReduceLROnPlateau, lambda mode: ModelCheckpoint("m", mode=mode)])
def test_an_unknown_mode_warns_and_falls_back_to_auto(cls):
    with pytest.warns(UserWarning, match=r"mode 'unknown' is unknown, fallback to auto mode"):
        callback = cls(mode="unknown")
    assert callback.mode == "auto" and callback.monitor_op is np.less  # val_loss in auto mode


def test_best_starts_as_keras_and_the_first_value_is_the_best(tmp_path):
    assert ModelCheckpoint("m").best is None and ModelCheckpoint("m", initial_value_threshold=0.3).best == 0.3
    stopping, plateau = EarlyStopping(monitor="loss", baseline=0.5), ReduceLROnPlateau(monitor="loss")
    stopping.on_train_begin()
    plateau.on_train_begin()
    assert stopping.best is None and plateau.best is None
    # A first value that no finite start would count as better: Keras saves it (best None).
    checkpoint = ModelCheckpoint(str(tmp_path / "best-{epoch}.keras"), monitor="score", mode="min",
                                 save_best_only=True)
    checkpoint.set_model(make_model())
    checkpoint.model.save = lambda path: open(path, "w").close()
    checkpoint.on_epoch_end(0, {"score": float("inf")})
    assert os.path.exists(tmp_path / "best-1.keras") and checkpoint.best == float("inf")
    checkpoint.on_epoch_end(1, {"score": 3.0})
    assert os.path.exists(tmp_path / "best-2.keras") and checkpoint.best == 3.0
    # None survives a state round trip (a resume before the first value).
    fresh = EarlyStopping(monitor="loss")
    fresh.on_train_begin()
    restored = EarlyStopping(monitor="loss")
    restored.load_state_dict(fresh.state_dict())
    assert restored.best is None
    plateau.load_state_dict(plateau.state_dict())
    assert plateau.best is None


def test_save_best_only_without_the_monitored_value_warns_and_saves(tmp_path):
    path = str(tmp_path / "model-{epoch}.keras")
    model = make_model()
    with pytest.warns(UserWarning, match=r"can save the best model only with `val_missing` available; saving anyway"):
        model.fit(X, Y, batch_size=5, epochs=2, verbose=0,
                  callbacks=[ModelCheckpoint(path, monitor="val_missing", mode="min", save_best_only=True)])
    assert sorted(os.listdir(tmp_path)) == ["model-1.keras", "model-2.keras"]


def test_lambda_callback_keeps_extra_keywords_and_takes_no_arguments():
    def custom_callback(logs):
        pass

    assert LambdaCallback(custom_method=custom_callback).custom_method is custom_callback
    assert isinstance(LambdaCallback(), LambdaCallback)
    seen = []
    fit(make_model(), [LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(epoch), note="kept")], epochs=2)
    assert seen == [0, 1]


@pytest.mark.parametrize("backup_dir", ["", None])
def test_backup_and_restore_refuses_an_empty_backup_dir_with_keras_error_type(backup_dir):
    with pytest.raises(ValueError, match=rf"Invalid `backup_dir`: expected a non-empty path .*"
                                         rf"received backup_dir={backup_dir!r}"):
        BackupAndRestore(backup_dir)
    with pytest.raises(TypeError, match=r"Invalid `backup_dir`.*backup_dir=5"):
        BackupAndRestore(5)
