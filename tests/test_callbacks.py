"""Callback hooks, History, ModelCheckpoint, EarlyStopping, CSVLogger and TensorBoard."""

from __future__ import annotations

import csv
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from meshfit.callbacks import (
    Callback,
    CallbackList,
    CSVLogger,
    EarlyStopping,
    History,
    ModelCheckpoint,
    ProgbarLogger,
    TensorBoard,
)


class StandInModel:
    """The parts of `meshfit.Model` callbacks use; records saves."""

    def __init__(self, is_chief: bool = True) -> None:
        self.stop_training = False
        self.strategy = SimpleNamespace(is_chief=is_chief, num_replicas_in_sync=2)
        self.optimizer = SimpleNamespace(learning_rate=0.01)
        self.module = torch.nn.Linear(3, 2)
        self.weights = [np.zeros(2)]
        self.saved: list[str] = []
        self.saved_weights: list[str] = []

    def save(self, path: str) -> None:
        self.saved.append(path)

    def save_weights(self, path: str) -> None:
        self.saved_weights.append(path)

    def get_weights(self) -> list[np.ndarray]:
        return [w.copy() for w in self.weights]

    def set_weights(self, weights: list[np.ndarray]) -> None:
        self.weights = [np.array(w) for w in weights]


def run_fit(callbacks, model, epoch_logs, steps=2, initial_epoch=0, batch_logs=None):
    """Drives the hooks as `fit` does; epoch ``e`` ends with ``epoch_logs[e]``; the weights are [e]."""
    callback_list = CallbackList(callbacks, model=model, epochs=len(epoch_logs), steps=steps, verbose=0)
    callback_list.on_train_begin()
    epochs_run = []
    for epoch in range(initial_epoch, len(epoch_logs)):
        callback_list.on_epoch_begin(epoch)
        for batch in range(steps):
            callback_list.on_train_batch_begin(batch)
            callback_list.on_train_batch_end(batch, batch_logs(epoch, batch) if batch_logs else {"loss": 1.0})
        model.weights = [np.full(2, float(epoch))]
        callback_list.on_epoch_end(epoch, dict(epoch_logs[epoch]))
        epochs_run.append(epoch)
        if model.stop_training:
            break
    callback_list.on_train_end()
    return epochs_run


class Recorder(Callback):
    def __init__(self, name, calls):
        super().__init__()
        self.name, self.calls = name, calls

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append((self.name, "epoch_end", epoch, dict(logs)))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append((self.name, "batch_end", batch, dict(logs)))

    def on_test_end(self, logs=None):
        self.calls.append((self.name, "test_end", None, dict(logs)))


class Stateful(Callback):
    def __init__(self, value=0):
        super().__init__()
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


# --- Callback and CallbackList -------------------------------------------------------------------



def test_base_callback_hooks_are_no_ops():
    callback = Callback()
    model = StandInModel()
    callback.set_model(model)
    callback.set_params({"epochs": 2, "steps": 3, "verbose": 1})
    assert callback.model is model and callback.params == {"epochs": 2, "steps": 3, "verbose": 1}
    callback_list = CallbackList([callback])
    for hook in (
        "on_train_begin",
        "on_train_end",
        "on_test_begin",
        "on_test_end",
        "on_predict_begin",
        "on_predict_end",
    ):
        getattr(callback_list, hook)()
    for hook in (
        "on_epoch_begin",
        "on_epoch_end",
        "on_train_batch_begin",
        "on_train_batch_end",
        "on_test_batch_begin",
        "on_test_batch_end",
        "on_predict_batch_begin",
        "on_predict_batch_end",
    ):
        getattr(callback_list, hook)(0, {"loss": 1.0})


def test_callback_list_calls_each_hook_on_each_callback_in_order():
    calls = []
    model = StandInModel()
    callback_list = CallbackList([Recorder("a", calls), Recorder("b", calls)], model=model, epochs=1)
    callback_list.on_train_batch_end(0, {"loss": 2.0})
    callback_list.on_test_end({"loss": 3.0})
    callback_list.on_epoch_end(0)
    assert calls == [
        ("a", "batch_end", 0, {"loss": 2.0}),
        ("b", "batch_end", 0, {"loss": 2.0}),
        ("a", "test_end", None, {"loss": 3.0}),
        ("b", "test_end", None, {"loss": 3.0}),
        ("a", "epoch_end", 0, {}),
        ("b", "epoch_end", 0, {}),
    ]
    assert all(c.model is model and c.params == {"epochs": 1} for c in callback_list)


def test_callback_list_adds_history_then_progbar_last_unless_given():
    # Keras 3's callback_list.py (3422977a): the History, then the ProgbarLogger, appended
    user = Callback()
    callback_list = CallbackList([user], add_history=True, add_progbar=True)
    kinds = [type(c) for c in callback_list]
    assert kinds == [Callback, History, ProgbarLogger]
    assert callback_list.history is callback_list.callbacks[1] and callback_list.progbar is callback_list.callbacks[-1]

    history, progbar = History(), ProgbarLogger()
    callback_list = CallbackList([history, user, progbar], add_history=True, add_progbar=True)
    assert callback_list.callbacks == [history, user, progbar]
    assert callback_list.history is history and callback_list.progbar is progbar


def test_callback_list_append_sets_model_and_params():
    model = StandInModel()
    callback_list = CallbackList(model=model, epochs=3, steps=4, verbose=0)
    callback = Callback()
    callback_list.append(callback)
    assert callback.model is model and callback.params == {"epochs": 3, "steps": 4, "verbose": 0}
    assert len(callback_list) == 1


def test_callback_list_rejects_non_callbacks():
    with pytest.raises(TypeError, match=r"Invalid `callbacks`.*received 'not a callback'"):
        CallbackList([Callback(), "not a callback"])


def test_callback_list_state_dict_round_trip_and_mismatch():
    saved = CallbackList([Stateful(1), Callback(), History(), Stateful(5)], add_progbar=True)
    saved.history.on_epoch_end(0, {"loss": 0.5})
    state = saved.state_dict()
    assert list(state) == ["0:Stateful", "1:History", "2:Stateful"]

    # A progbar more or less (verbose changed) does not shift the keys.
    restored = CallbackList([Stateful(), Callback(), History(), Stateful()], add_progbar=False)
    restored.load_state_dict(state)
    assert [c.value for c in restored if isinstance(c, Stateful)] == [1, 5]
    assert restored.callbacks[2].history == {"loss": [0.5]}

    with pytest.raises(ValueError, match=r"do not match.*0:Stateful.*1:Stateful.*received.*2:Stateful"):
        CallbackList([Stateful(), Stateful()]).load_state_dict(state)


# --- History --------------------------------------------------------------------------------------


def test_history_records_floats_and_extends_across_fits():
    model = StandInModel()
    history = History()
    run_fit(
        [history],
        model,
        [{"loss": torch.tensor(0.5), "val_loss": np.float32(0.75)}, {"loss": 0.25, "val_loss": 0.5}],
    )
    assert history.history == {"loss": [0.5, 0.25], "val_loss": [0.75, 0.5]}
    assert all(type(v) is float for values in history.history.values() for v in values)
    assert history.epoch == [0, 1]
    assert model.history is history
    run_fit([history], model, [{"loss": 0.125, "val_loss": 0.25}])
    assert history.history["loss"] == [0.5, 0.25, 0.125]
    assert history.epoch == [0, 1, 0]


def test_history_state_dict_gives_a_resumed_fit_the_full_record():
    first = History()
    run_fit([first], StandInModel(), [{"loss": 3.0}, {"loss": 2.0}])
    resumed = History()
    resumed.load_state_dict(first.state_dict())
    run_fit([resumed], StandInModel(), [{"loss": 3.0}, {"loss": 2.0}, {"loss": 1.0}], initial_epoch=2)
    assert resumed.history == {"loss": [3.0, 2.0, 1.0]} and resumed.epoch == [0, 1, 2]


# --- ModelCheckpoint ------------------------------------------------------------------------------


def test_checkpoint_every_epoch_with_templated_names(tmp_path):
    model = StandInModel()
    template = str(tmp_path / "ckpt" / "model-{epoch:02d}-{val_loss:.2f}")
    run_fit([ModelCheckpoint(template)], model, [{"val_loss": 0.5}, {"val_loss": 0.25}])
    assert model.saved == [str(tmp_path / "ckpt" / "model-01-0.50"), str(tmp_path / "ckpt" / "model-02-0.25")]
    assert model.saved_weights == []
    assert (tmp_path / "ckpt").is_dir()


def test_checkpoint_int_save_freq_counts_batches_across_epochs(tmp_path):
    model = StandInModel()
    checkpoint = ModelCheckpoint(str(tmp_path / "w-{epoch}-{batch}"), save_freq=3, save_weights_only=True)
    run_fit([checkpoint], model, [{}, {}], steps=5)  # 10 batches: saves after global batches 3, 6, 9
    assert [os.path.basename(p) for p in model.saved_weights] == ["w-1-3", "w-2-1", "w-2-4"]
    assert model.saved == []


def test_checkpoint_int_save_freq_resumes_its_count(tmp_path):
    template = str(tmp_path / "w-{epoch}-{batch}")
    first_model = StandInModel()
    first = ModelCheckpoint(template, save_freq=4, save_weights_only=True)
    run_fit([first], first_model, [{}], steps=6)  # global batch 4 saved; 2 batches counted since
    resumed_model = StandInModel()
    resumed = ModelCheckpoint(template, save_freq=4, save_weights_only=True)
    resumed.load_state_dict(first.state_dict())
    run_fit([resumed], resumed_model, [{}, {}], steps=6, initial_epoch=1)  # global batches 8 and 12
    assert [os.path.basename(p) for p in first_model.saved_weights] == ["w-1-4"]
    assert [os.path.basename(p) for p in resumed_model.saved_weights] == ["w-2-2", "w-2-6"]


def test_checkpoint_save_best_only(tmp_path, capsys):
    model = StandInModel()
    checkpoint = ModelCheckpoint(str(tmp_path / "best-{epoch}"), save_best_only=True, verbose=1)
    run_fit([checkpoint], model, [{"val_loss": v} for v in (1.0, 0.5, 0.7, 0.4)])
    assert [os.path.basename(p) for p in model.saved] == ["best-1", "best-2", "best-4"]
    assert checkpoint.best == 0.4
    out = capsys.readouterr().out
    assert "Epoch 3: val_loss did not improve from 0.50000" in out
    assert f"Epoch 4: val_loss improved from 0.50000 to 0.40000, saving model to {tmp_path / 'best-4'}" in out


def test_checkpoint_auto_mode_maximises_accuracy_and_respects_threshold(tmp_path):
    model = StandInModel()
    checkpoint = ModelCheckpoint(
        str(tmp_path / "m{epoch}"), monitor="val_accuracy", save_best_only=True, initial_value_threshold=0.6
    )
    run_fit([checkpoint], model, [{"val_accuracy": v} for v in (0.5, 0.7, 0.65, 0.9)])
    assert [os.path.basename(p) for p in model.saved] == ["m2", "m4"]
    minimise = ModelCheckpoint("x", monitor="accuracy", mode="min", save_best_only=True)
    run_fit([minimise], model, [{"accuracy": 0.5}])
    assert minimise.best == 0.5


def test_checkpoint_missing_monitor_warns_and_saves_as_keras(tmp_path):
    # Keras 3's _should_save_model: "Can save best model only with val_loss available." then saves (issue 25).
    model = StandInModel()
    with pytest.warns(UserWarning, match="val_loss"):
        run_fit([ModelCheckpoint(str(tmp_path / "m"), save_best_only=True)], model, [{"loss": 1.0}])
    assert model.saved == [str(tmp_path / "m")]


def test_checkpoint_saves_on_every_worker(tmp_path):
    model = StandInModel(is_chief=False)
    run_fit([ModelCheckpoint(str(tmp_path / "m{epoch}"))], model, [{}, {}])
    assert len(model.saved) == 2


@pytest.mark.parametrize("save_freq", [-1, 0, "batch", True, 2.5])
def test_checkpoint_rejects_bad_save_freq(save_freq):
    with pytest.raises(
        ValueError,
        match=rf"Invalid `save_freq`: expected 'epoch' or a positive int, "
        rf"received save_freq={save_freq!r}\.",
    ):
        ModelCheckpoint("m", save_freq=save_freq)


def test_checkpoint_falls_back_to_auto_on_a_bad_mode_and_rejects_a_bad_filepath():
    # Keras 3's MonitorCallback: an unknown mode warns and falls back to "auto" (issue 25 point 9).
    with pytest.warns(UserWarning, match=r"ModelCheckpoint mode 'best' is unknown, fallback to auto mode"):
        checkpoint = ModelCheckpoint("m", mode="best")
    assert checkpoint.mode == "auto" and checkpoint.monitor_op is np.less  # val_loss
    with pytest.raises(TypeError, match="Invalid `filepath`"):
        ModelCheckpoint(None)
    with pytest.raises(ValueError, match="could not format"):
        run_fit([ModelCheckpoint("m-{val_acc}")], StandInModel(), [{"loss": 1.0}])


# --- EarlyStopping --------------------------------------------------------------------------------


def test_early_stopping_stops_after_patience_and_restores_best_weights(capsys):
    model = StandInModel()
    early_stopping = EarlyStopping(monitor="loss", patience=2, restore_best_weights=True, verbose=1)
    losses = [1.0, 0.9, 0.95, 0.97, 0.5, 0.4]
    epochs_run = run_fit([early_stopping], model, [{"loss": v} for v in losses])
    assert epochs_run == [0, 1, 2, 3]
    assert model.stop_training is True
    assert early_stopping.stopped_epoch == 3 and early_stopping.best_epoch == 1
    np.testing.assert_array_equal(model.weights[0], [1.0, 1.0])  # the weights after epoch 1
    out = capsys.readouterr().out
    assert "Epoch 4: early stopping" in out
    assert "Restoring model weights from the end of the best epoch: 2." in out


def test_early_stopping_min_delta_mode_and_start_from_epoch():
    model = StandInModel()
    # Improvements of 0.01 do not beat min_delta=0.05: stops at epoch 1 (patience 0 counts from epoch 1).
    early_stopping = EarlyStopping(monitor="val_accuracy", min_delta=0.05)
    assert run_fit([early_stopping], model, [{"val_accuracy": v} for v in (0.5, 0.51, 0.52)]) == [0, 1]

    model = StandInModel()
    warm_up = EarlyStopping(monitor="loss", start_from_epoch=2)
    assert run_fit([warm_up], model, [{"loss": v} for v in (1.0, 2.0, 3.0, 4.0, 5.0)]) == [0, 1, 2, 3]


def test_early_stopping_baseline():
    model = StandInModel()
    early_stopping = EarlyStopping(monitor="val_loss", patience=2, baseline=0.5)
    # Improving but never below the baseline: Keras 3 goes on while each epoch improves
    assert run_fit([early_stopping], model, [{"val_loss": v} for v in (0.9, 0.8, 0.7, 0.6)]) == [0, 1, 2, 3]
    assert early_stopping.stopped_epoch == 0
    # ... and stops once patience runs out without an improvement
    early_stopping = EarlyStopping(monitor="val_loss", patience=2, baseline=0.5)
    assert run_fit([early_stopping], StandInModel(), [{"val_loss": v} for v in (0.9, 0.8, 0.85, 0.86, 0.87)]) \
        == [0, 1, 2]


def test_early_stopping_restores_the_best_epoch_when_none_beats_the_baseline():
    # Keras 3's early_stopping_test.py::test_early_stopping_final_weights_when_restoring_model_weights (3422977a)
    class DummyModel:
        stop_training = False
        weights = -1

        def get_weights(self):
            return self.weights

        def set_weights(self, weights):
            self.weights = weights

    stopper = EarlyStopping(monitor="val_loss", patience=5, baseline=0.5, restore_best_weights=True)
    stopper.set_model(DummyModel())
    stopper.on_train_begin()
    epochs_trained = 0
    for epoch, loss in enumerate([0.9, 0.8, 0.7, 0.71, 0.72, 0.73]):
        epochs_trained += 1
        stopper.model.weights = epoch
        stopper.on_epoch_end(epoch, logs={"val_loss": loss})
        if stopper.model.stop_training:
            break
    stopper.on_train_end()
    assert epochs_trained == 5
    assert stopper.model.get_weights() == 2


def test_early_stopping_restarts_on_a_second_fit_and_warns_on_missing_key():
    model = StandInModel()
    early_stopping = EarlyStopping(monitor="loss", patience=1)
    run_fit([early_stopping], model, [{"loss": v} for v in (1.0, 2.0, 3.0)])
    assert early_stopping.stopped_epoch == 1
    model.stop_training = False
    run_fit([early_stopping], model, [{"loss": v} for v in (5.0, 4.0)])
    assert early_stopping.stopped_epoch == 0 and early_stopping.best == 4.0
    with pytest.warns(UserWarning, match=r"`val_loss` which is not available. Available metrics are: loss"):
        run_fit([EarlyStopping()], StandInModel(), [{"loss": 1.0}])


def test_early_stopping_state_dict_resumes_where_it_was():
    losses = [1.0, 0.5, 0.6, 0.7, 0.8, 0.9]
    first = EarlyStopping(monitor="loss", patience=3, restore_best_weights=True)
    run_fit([first], StandInModel(), [{"loss": v} for v in losses[:3]])  # "crashes" after epoch 2
    state = first.state_dict()
    assert state["wait"] == 1 and state["best"] == 0.5 and state["best_epoch"] == 1
    np.testing.assert_array_equal(state["best_weights"][0], [1.0, 1.0])

    resumed = EarlyStopping(monitor="loss", patience=3, restore_best_weights=True)
    resumed.load_state_dict(state)
    model = StandInModel()
    epochs_run = run_fit([resumed], model, [{"loss": v} for v in losses], initial_epoch=3)
    assert epochs_run == [3, 4] and resumed.stopped_epoch == 4
    np.testing.assert_array_equal(model.weights[0], [1.0, 1.0])

    class RestoresInTrainBegin(Callback):  # as BackupAndRestore may, after EarlyStopping's own hook
        def on_train_begin(self, logs=None):
            late.load_state_dict(state)

    late = EarlyStopping(monitor="loss", patience=3)
    restorer = RestoresInTrainBegin()
    assert run_fit([late, restorer], StandInModel(), [{"loss": v} for v in losses], initial_epoch=3) == [3, 4]
    run_fit([late], StandInModel(), [{"loss": 2.0}])  # a later, fresh fit starts afresh
    assert late.best == 2.0 and late.wait == 0


def test_early_stopping_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"Invalid `patience`: expected an int >= 0, received patience=-1\."):
        EarlyStopping(patience=-1)
    with pytest.warns(UserWarning, match=r"EarlyStopping mode 'maximum' is unknown, fallback to auto mode"):
        assert EarlyStopping(mode="maximum", monitor="val_accuracy").monitor_op is np.greater  # Keras: warns
    with pytest.raises(ValueError, match=r"Invalid `start_from_epoch`"):
        EarlyStopping(start_from_epoch=-2)


# --- CSVLogger ------------------------------------------------------------------------------------


def test_csv_logger_writes_sorted_columns_and_one_row_per_epoch(tmp_path):
    path = tmp_path / "log.csv"
    logs = [
        {"loss": 0.5, "accuracy": 0.75, "val_loss": 0.25, "val_accuracy": 1.0},
        {"loss": torch.tensor(0.25), "accuracy": 0.875, "val_loss": 0.125, "val_accuracy": 1.0},
    ]
    run_fit([CSVLogger(path)], StandInModel(), logs)
    assert path.read_text().splitlines() == [
        "epoch,accuracy,loss,val_accuracy,val_loss",
        "0,0.75,0.5,1.0,0.25",
        "1,0.875,0.25,1.0,0.125",
    ]


def test_csv_logger_reserves_val_columns_and_flushes_each_row(tmp_path):
    path = tmp_path / "log.csv"

    class ReadsFile(Callback):
        rows_seen = []

        def on_epoch_end(self, epoch, logs=None):
            self.rows_seen.append(len(path.read_text().splitlines()))

    run_fit([CSVLogger(path, separator=";"), ReadsFile()], StandInModel(), [{"loss": 0.5}, {"loss": 0.25}])
    assert ReadsFile.rows_seen == [2, 3]  # the row is on disk before the next callback runs
    with open(path, newline="") as f:
        rows = list(csv.reader(f, delimiter=";"))
    assert rows == [["epoch", "loss", "val_loss"], ["0", "0.5", "NA"], ["1", "0.25", "NA"]]


def test_csv_logger_append_writes_no_second_header(tmp_path):
    path = tmp_path / "log.csv"
    run_fit([CSVLogger(path)], StandInModel(), [{"loss": 0.5, "val_loss": 0.5}])
    run_fit([CSVLogger(path, append=True)], StandInModel(), [{"loss": 0.25, "val_loss": 0.25}])
    assert path.read_text().splitlines() == ["epoch,loss,val_loss", "0,0.5,0.5", "0,0.25,0.25"]
    run_fit([CSVLogger(path)], StandInModel(), [{"loss": 1.0, "val_loss": 1.0}])
    assert path.read_text().splitlines() == ["epoch,loss,val_loss", "0,1.0,1.0"]


def test_csv_logger_writes_on_the_chief_only(tmp_path):
    path = tmp_path / "log.csv"
    run_fit([CSVLogger(path)], StandInModel(is_chief=False), [{"loss": 0.5}])
    assert not path.exists()
    run_fit([CSVLogger(path)], SimpleNamespace(stop_training=False, weights=None), [{"loss": 0.5}])
    assert path.exists()  # no strategy: a single process, the chief


def test_csv_logger_resume_keeps_only_the_rows_before_the_backup(tmp_path):
    path = tmp_path / "log.csv"
    logs = [{"loss": float(v), "val_loss": float(v)} for v in range(4)]
    first = CSVLogger(path)
    run_fit([first], StandInModel(), logs[:2])
    state = first.state_dict()
    run_fit([first], StandInModel(), logs[:3])  # epoch 2 ran past the backup, then the job died

    class RestoresInTrainBegin(Callback):  # as BackupAndRestore may, after CSVLogger's own hook
        def on_train_begin(self, logs=None):
            resumed.load_state_dict(state)

    resumed = CSVLogger(path)
    run_fit([resumed, RestoresInTrainBegin()], StandInModel(), logs, initial_epoch=2)
    assert path.read_text().splitlines() == [
        "epoch,loss,val_loss",
        "0,0.0,0.0",
        "1,1.0,1.0",
        "2,2.0,2.0",
        "3,3.0,3.0",
    ]


# --- TensorBoard ----------------------------------------------------------------------------------


def _events(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0, "histograms": 0})
    accumulator.Reload()
    return accumulator


def test_tensorboard_writes_keras_layout_and_scalars(tmp_path):
    model = StandInModel()
    board = TensorBoard(log_dir=tmp_path / "logs", update_freq=2, histogram_freq=1, write_graph=True)
    logs = [
        {"loss": 0.5, "accuracy": 0.25, "val_loss": 0.75, "val_accuracy": 0.125},
        {"loss": 0.25, "accuracy": 0.5, "val_loss": 0.5, "val_accuracy": 0.375},
    ]
    run_fit([board], model, logs, steps=3, batch_logs=lambda e, b: {"loss": 10.0 * e + b})
    train, validation = _events(tmp_path / "logs" / "train"), _events(tmp_path / "logs" / "validation")

    def scalars(accumulator, tag):
        return [(event.step, pytest.approx(event.value)) for event in accumulator.Scalars(tag)]

    assert scalars(train, "epoch_loss") == [(0, 0.5), (1, 0.25)]
    assert scalars(train, "epoch_accuracy") == [(0, 0.25), (1, 0.5)]
    assert scalars(train, "epoch_learning_rate") == [(0, 0.01), (1, 0.01)]
    assert scalars(validation, "epoch_loss") == [(0, 0.75), (1, 0.5)]
    assert scalars(validation, "epoch_accuracy") == [(0, 0.125), (1, 0.375)]
    assert "epoch_val_loss" not in train.Tags()["scalars"]
    # Global batches 2, 4, 6 are epoch 0 batch 1, epoch 1 batches 0 and 2.
    assert scalars(train, "batch_loss") == [(2, 1.0), (4, 10.0), (6, 12.0)]
    assert set(train.Tags()["histograms"]) == {"weight", "bias"}
    assert [event.step for event in train.Histograms("weight")] == [0, 1]
    assert board._writers == {}  # closed at the end of training


def test_tensorboard_writes_on_the_chief_only_and_validates(tmp_path):
    run_fit([TensorBoard(log_dir=tmp_path / "logs")], StandInModel(is_chief=False), [{"loss": 1.0}])
    assert not (tmp_path / "logs").exists()
    with pytest.raises(ValueError, match=r"Invalid `update_freq`.*received update_freq=0\."):
        TensorBoard(update_freq=0)
    with pytest.raises(ValueError, match=r"Invalid `histogram_freq`"):
        TensorBoard(histogram_freq=-1)
    assert TensorBoard(update_freq="batch").update_freq == 1
