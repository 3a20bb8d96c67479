"""Keras 3's logs of a train_step override (trainer.py _get_metrics_result_or_logs), get_metrics_result's values,
its EarlyStopping baseline rule and its callback order (callback_list.py: the progress bar last),
keras-team/keras @ 3422977a5e38."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _multiproc import run_distributed
from torch import nn

import meshfit as mf

torch.set_num_threads(1)


def data(rows: int = 40):
    x = np.random.RandomState(0).rand(rows, 4).astype("float32")
    y = np.random.RandomState(1).rand(rows, 3).astype("float32")
    return x, y


def linear(cls=mf.Model, steps_per_execution: int = 1, metrics=None) -> mf.Model:
    torch.manual_seed(0)
    model = cls(nn.Linear(4, 3))
    model.compile(optimizer=mf.optimizers.SGD(learning_rate=0.05), loss="mse", metrics=metrics,
                  steps_per_execution=steps_per_execution)
    return model


class OwnLossStep(mf.Model):
    """A train_step that tracks no compiled metric and returns its own ``{name: loss}`` (``"loss"``)."""

    logged_name = "loss"

    def train_step(self, data):
        x, y = data
        self.optimizer.zero_grad()
        loss = torch.mean((self(x) - y) ** 2)
        loss.backward()
        self.optimizer.step()
        return {self.logged_name: loss.detach()}


class OwnDictStep(OwnLossStep):
    """A train_step that returns a dict of its own names only."""

    logged_name = "custom"


def batch_logs_of(model, **fit_kwargs):
    seen = []
    cb = mf.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(dict(logs)))
    history = model.fit(*data(), batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[cb], **fit_kwargs)
    return seen, history


# ---- epoch logs of a train_step override (trainer.py `_get_metrics_result_or_logs`) -------------------
def test_train_step_returning_its_own_loss_logs_that_loss_per_epoch():
    seen, history = batch_logs_of(linear(OwnLossStep, metrics=["mae"]))
    last_of_each_epoch = [seen[9]["loss"], seen[19]["loss"]]
    assert last_of_each_epoch[0] > 0
    assert history.history["loss"] == pytest.approx(last_of_each_epoch)  # (the unused metrics' [0.0, 0.0] before)
    assert set(history.history) == {"loss"}


def test_train_step_returning_its_own_dict_logs_only_that_dict():
    seen, history = batch_logs_of(linear(OwnDictStep, metrics=["mae"]))
    assert all(set(logs) == {"custom"} for logs in seen)
    assert set(history.history) == {"custom"}


# ---- EarlyStopping baseline (early_stopping.py; early_stopping_test.py) ----------------------------------
def test_early_stopping_keeps_training_while_improving_short_of_the_baseline():
    class Dummy:
        stop_training = False

        def get_weights(self):
            return []

    stopper = mf.callbacks.EarlyStopping(monitor="val_loss", patience=2, baseline=0.5)
    stopper.set_model(Dummy())
    stopper.on_train_begin()
    trained = 0
    for epoch, loss in enumerate([0.9, 0.8, 0.7, 0.6]):
        trained += 1
        stopper.on_epoch_end(epoch, {"val_loss": loss})
        if stopper.model.stop_training:
            break
    assert trained == 4 and stopper.stopped_epoch == 0  # (Keras 2's rule stopped after epoch 1)


# ---- ProgbarLogger is appended last (callback_list.py _add_default_callbacks) ---------------------------
def test_progbar_epoch_line_shows_the_learning_rate_that_reduce_lr_logs(capsys):
    model = linear()
    model.fit(*data(), batch_size=4, epochs=1, verbose=2, callbacks=[mf.callbacks.ReduceLROnPlateau(monitor="loss")])
    assert "learning_rate" in capsys.readouterr().out


# ---- stop_evaluating / stop_predicting (Keras 3's trainer_test.py::test_stop_loop, 3422977a) -------------
class StopAt(mf.callbacks.Callback):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.count, self.tests, self.predicts = count, 0, 0

    def on_test_batch_end(self, batch, logs=None):
        self.tests += 1
        if self.tests == self.count:
            self.model.stop_evaluating = True

    def on_predict_batch_end(self, batch, logs=None):
        self.predicts += 1
        if self.predicts == self.count:
            self.model.stop_predicting = True


def test_stop_evaluating_in_a_test_batch_hook_ends_evaluate():
    x, y = data()
    stopper = StopAt(3)
    model = linear()
    result = model.evaluate(x, y, batch_size=4, verbose=0, callbacks=[stopper], return_dict=True)
    assert stopper.tests == 3
    assert result["loss"] == pytest.approx(linear().evaluate(x[:12], y[:12], batch_size=4, verbose=0), rel=1e-6)
    stopper.count = 0  # a new evaluate starts with stop_evaluating False
    assert model.evaluate(x, y, batch_size=4, verbose=0, callbacks=[stopper], return_dict=True) == result | {
        "loss": pytest.approx(linear().evaluate(x, y, batch_size=4, verbose=0), rel=1e-6)}
    assert stopper.tests == 13


def test_stop_predicting_in_a_predict_batch_hook_ends_predict():
    x, _ = data()
    stopper = StopAt(3)
    model = linear(steps_per_execution=2)  # an execution of 2 steps: stops after the one whose hook set it
    outputs = model.predict(x, batch_size=4, verbose=0, callbacks=[stopper])
    assert stopper.predicts == 3
    assert outputs.shape == (24, 3)
    np.testing.assert_allclose(outputs, model.predict(x[:24], batch_size=4, verbose=0), rtol=1e-6)
    assert model.predict(x, batch_size=4, verbose=0).shape == (40, 3)


def _classes(rows: int = 10):
    rs = np.random.RandomState(0)
    return rs.rand(rows, 4).astype("float32"), rs.randint(0, 3, size=rows).astype("int64")


def _classifier(cls=mf.Model, learning_rate: float = 1e-30) -> mf.Model:
    torch.manual_seed(0)
    model = cls(nn.Linear(4, 3))
    model.compile(optimizer=mf.optimizers.SGD(learning_rate=learning_rate),
                  loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def _floats(results) -> dict[str, float]:
    return {name: float(value) for name, value in results.items()}


# ---- get_metrics_result(): the values of the moment it was called (Keras 3) -------------------------------
def test_get_metrics_result_kept_by_a_callback_keeps_the_values_it_was_taken_with():
    """Keras 3 (trainer.py `get_metrics_result`): ``return_metrics[metric.name] = metric.result()``, a new
    dict of new tensors (``Mean.result`` is ``divide_no_nan(total, count)``, a new tensor), so a callback
    that keeps ``model.get_metrics_result()`` at each epoch's end (a custom history) holds each epoch's values,
    the ones History records (a view that read the metrics when read showed the second epoch's loss twice)."""
    x, y = _classes()
    kept = []
    keep = mf.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: kept.append(keep.model.get_metrics_result()))
    history = _classifier(learning_rate=0.5).fit(x, y, batch_size=3, epochs=2, shuffle=False, verbose=0,
                                               callbacks=[keep])
    assert history.history["loss"][0] != history.history["loss"][1]  # the epochs differ
    assert [float(r["loss"]) for r in kept] == pytest.approx(history.history["loss"], rel=1e-6)


def test_get_metrics_result_taken_after_fit_is_not_changed_by_a_later_evaluate():
    """Keras 3 (trainer.py `get_metrics_result`): a dict of the results computed at the call."""
    x, y = _classes()
    model = _classifier()
    history = model.fit(x, y, batch_size=3, epochs=1, shuffle=False, verbose=0)
    after_fit = model.get_metrics_result()
    model.evaluate(x[:4], y[:4], batch_size=4, verbose=0)
    assert _floats(after_fit) == pytest.approx({k: v[-1] for k, v in history.history.items()}, rel=1e-6)


# ---- super().train_step's dict, edited by an override --------------------------------------------------------
class _DropsAccuracy(mf.Model):
    def train_step(self, data):
        logs = super().train_step(data)
        del logs["accuracy"]
        return logs


class _ReplacesLossAndAddsOne(mf.Model):
    def train_step(self, data):
        logs = super().train_step(data)
        logs["loss"] = 0.0
        logs["extra"] = 1.0
        return logs


def test_a_metric_deleted_from_super_train_step_logs_is_not_logged():
    """Keras 3: ``super().train_step`` returns a plain dict; ``del logs["accuracy"]`` leaves ``{"loss"}``,
    which torch/trainer.py `fit` hands to on_train_batch_end as it is, and whose keys differ from the
    metrics', so `_get_metrics_result_or_logs` makes it the epoch's logs: no "accuracy" anywhere."""
    x, y = _classes()
    seen = []
    cb = mf.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(sorted(logs)))
    history = _classifier(_DropsAccuracy).fit(x, y, batch_size=3, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    assert seen == [["loss"]] * 4
    assert sorted(history.history) == ["loss"]


def test_an_override_that_adds_a_name_logs_its_own_values_at_the_epoch_end():
    """Keras 3 (trainer.py `_get_metrics_result_or_logs`): the last step's logs ``{"loss": 0.0, "accuracy":
    ..., "extra": 1.0}`` have other keys than the metrics' ``{"loss", "accuracy"}``, so they are the epoch's
    logs: History's loss is 0.0."""
    x, y = _classes()
    history = _classifier(_ReplacesLossAndAddsOne).fit(x, y, batch_size=3, epochs=1, shuffle=False, verbose=0)
    assert history.history["extra"] == [1.0]
    assert history.history["loss"] == [0.0]


# ---- overrides of compute_metrics and get_metrics_result ------------------------------------------------------
class _FixedMetricsResult(mf.Model):
    """get_metrics_result overridden with the metrics' own names and its own values."""

    def get_metrics_result(self):
        return {name: 42.0 for name in super().get_metrics_result()}


class _FixedComputeMetrics(mf.Model):
    """compute_metrics overridden: updates the metrics, returns its own values under the metrics' names."""

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        return {name: 7.0 for name in super().compute_metrics(x, y, y_pred, sample_weight)}


def _last_batch_logs_and_history(cls: type[mf.Model]) -> tuple[dict, dict]:
    """One epoch of ``cls`` on 4 batches: the last batch's logs as a callback saw them, and History's."""
    x, y = _classes()
    seen = []
    cb = mf.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(dict(logs)))
    history = _classifier(cls).fit(x, y, batch_size=3, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    return seen[-1], history.history


@pytest.mark.xfail(strict=True, reason="listed in docs/guides/differences.md: fit logs the compiled metrics reduced over "
                   "replicas, not a get_metrics_result override's values")
def test_a_get_metrics_result_override_is_what_fit_logs_per_batch_and_per_epoch():
    """Keras 3: torch train_step returns compute_metrics(...) = self.get_metrics_result() -> the batch logs;
    at the epoch end `_get_metrics_result_or_logs` calls self.get_metrics_result() (keys match) -> 42.0."""
    last_batch, history = _last_batch_logs_and_history(_FixedMetricsResult)
    assert last_batch == {"loss": 42.0, "accuracy": 42.0}
    assert history == {"loss": [42.0], "accuracy": [42.0]}


@pytest.mark.xfail(strict=True, reason="listed in docs/guides/differences.md: evaluate returns the compiled metrics "
                   "reduced over replicas, not a get_metrics_result override's values")
def test_a_get_metrics_result_override_is_what_evaluate_returns():
    x, y = _classes()
    model = _classifier(_FixedMetricsResult)
    assert model.evaluate(x, y, batch_size=3, verbose=0, return_dict=True) == {"loss": 42.0, "accuracy": 42.0}


@pytest.mark.xfail(strict=True, reason="listed in docs/guides/differences.md: the batch logs are the compiled "
                   "metrics reduced over replicas, not a compute_metrics override's dict")
def test_a_compute_metrics_override_is_what_fit_logs_per_batch():
    """Keras 3: the batch logs are train_step's return value, compute_metrics(...)'s dict (7.0); the epoch's are
    get_metrics_result()'s (not overridden, keys match): the metrics' values."""
    last_batch, history = _last_batch_logs_and_history(_FixedComputeMetrics)
    assert last_batch == {"loss": 7.0, "accuracy": 7.0}
    assert history["loss"][0] != 7.0


def test_a_compute_metrics_set_on_the_instance_is_called_by_the_built_in_step():
    x, y = _classes()
    model = _classifier()
    calls = []
    builtin = model.compute_metrics

    def counting(*args, **kwargs):
        calls.append(1)
        return builtin(*args, **kwargs)

    model.compute_metrics = counting
    model.fit(x, y, batch_size=3, epochs=1, shuffle=False, verbose=0)
    assert len(calls) == 4


class _SetsRank(mf.Model):
    """Edits super().train_step's results in place: sets a value that differs between processes."""

    def train_step(self, data):
        logs = super().train_step(data)
        logs["mine"] = float(torch.distributed.get_rank())
        return logs


class _OwnDictWithRank(mf.Model):
    """The same override, written on a copy of the results (a dict of its own names)."""

    def train_step(self, data):
        logs = dict(super().train_step(data))
        logs["mine"] = float(torch.distributed.get_rank())
        return logs


def _epoch_logs_of_each(rank: int, world: int) -> dict:
    x, y = _classes(16)
    out = {}
    for cls in (_SetsRank, _OwnDictWithRank):
        strategy = mf.MultiWorkerMirroredStrategy()
        with strategy.scope():
            model = _classifier(cls)
        seen = []
        cb = mf.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs, seen=seen: seen.append(dict(logs)))
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
        out[cls.__name__] = seen[-1]["mine"]
    return out


def test_a_value_set_in_super_train_step_results_is_one_value_on_every_process_at_the_epoch_end():
    """On 2 workers a value an override sets in ``super().train_step``'s results is, at the epoch's end, the
    workers' mean, as for an override's own dict: every process's callbacks decide on one value."""
    r0, r1 = run_distributed(_epoch_logs_of_each, world_size=2, timeout=240)
    assert r0["_OwnDictWithRank"] == r1["_OwnDictWithRank"] == 0.5  # the own-dict path: agreed
    assert r0["_SetsRank"] == r1["_SetsRank"]
