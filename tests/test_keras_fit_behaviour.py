"""fit / evaluate / predict as Keras 3 runs them (issue 25, points 1-7), on one process.

Each expectation is Keras 3's (keras/src/trainers/epoch_iterator.py, backend/torch/trainer.py,
trainer_test.py and the guide "Customizing what happens in fit()"); the 2-worker cases are in
test_keras_fit_multiworker.py.
"""

from __future__ import annotations

import runpy
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from _interrupt import InterruptAtStepEnd, StopAfterBatch
from torch import nn

import meshfit as mf

ROOT = Path(__file__).resolve().parents[1]


def linear_model(steps_per_execution: int = 1, metrics=None) -> mf.Model:
    torch.manual_seed(0)
    model = mf.Model(nn.Linear(2, 1))
    model.compile(optimizer=mf.optimizers.SGD(learning_rate=0.05), loss="mse", metrics=metrics,
                  steps_per_execution=steps_per_execution)
    return model


def ten_batches():
    """40 rows in batches of 4: 10 batches; row i has target i (the batch is y[0] // 4)."""
    x = np.arange(80, dtype="float32").reshape(40, 2) / 80
    y = np.arange(40, dtype="float32").reshape(40, 1)
    return x, y


class Recorder(mf.callbacks.Callback):
    """Per epoch: the batch-begin and batch-end indices, and the first target of each batch trained on."""

    def __init__(self) -> None:
        super().__init__()
        self.begins, self.ends, self.batches = [], [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.begins.append([])
        self.ends.append([])

    def on_train_batch_begin(self, batch, logs=None):
        self.begins[-1].append(batch)

    def on_train_batch_end(self, batch, logs=None):
        self.ends[-1].append(batch)


class Spy(mf.Model):
    def __init__(self, module, seen):
        super().__init__(module)
        self.seen = seen

    def train_step(self, data):
        self.seen.append(int(data[1][0, 0]) // 4)
        return super().train_step(data)


# ---- 1. validation inside fit calls the fit callbacks' test hooks ---------------------------------
def test_validation_in_fit_calls_the_callbacks_test_hooks():
    seen = []
    cb = mf.callbacks.LambdaCallback(on_test_begin=lambda logs: seen.append("begin"),
                                     on_test_batch_begin=lambda batch, logs: seen.append(("b", batch)),
                                     on_test_batch_end=lambda batch, logs: seen.append(batch),
                                     on_test_end=lambda logs: seen.append(("end", sorted(logs))))
    m = mf.Model(nn.Linear(2, 1))
    m.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 2), "f4"), np.ones((8, 1), "f4")
    m.fit(x, y, batch_size=4, validation_data=(x, y), callbacks=[cb], verbose=0, epochs=2)
    once = ["begin", ("b", 0), 0, ("b", 1), 1, ("end", ["loss"])]
    assert seen == once * 2  # Keras passes fit's callbacks to the evaluate of each validation
    seen.clear()
    m.fit(x, y, batch_size=4, validation_data=(x, y), validation_freq=2, callbacks=[cb], verbose=0, epochs=2)
    assert seen == once  # only the epochs that validate


# ---- 2. finite data without a length; steps_per_epoch beyond the data; infinite data -------------
class Stream(torch.utils.data.IterableDataset):
    """Finite, with no __len__: 5 batches of 4 rows (the batch number is the target // 4)."""

    def __iter__(self):
        x, y = ten_batches()
        for i in range(5):
            yield torch.from_numpy(x[4 * i:4 * i + 4]), torch.from_numpy(y[4 * i:4 * i + 4])


def test_data_of_unknown_length_runs_the_epoch_until_it_ends():
    seen = []
    model = Spy(nn.Linear(2, 1), seen)
    model.compile(optimizer="sgd", loss="mse")
    loader = torch.utils.data.DataLoader(Stream(), batch_size=None)
    with pytest.raises(TypeError):
        len(loader)
    recorder = Recorder()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ran out of data")  # no steps_per_epoch was asked for
        history = model.fit(loader, epochs=2, verbose=0, callbacks=[recorder])
    assert seen == [0, 1, 2, 3, 4] * 2 and recorder.ends == [[0, 1, 2, 3, 4]] * 2
    assert len(history.history["loss"]) == 2
    # evaluate and predict read it to its end too.
    x, y = ten_batches()
    expected = model.evaluate(x[:20], y[:20], batch_size=4, verbose=0)
    assert model.evaluate(loader, verbose=0) == pytest.approx(expected, rel=1e-6)
    assert model.predict(loader, verbose=0).shape == (20, 1)


def test_steps_per_epoch_beyond_the_data_ends_the_epoch_with_one_warning():
    seen = []
    model = Spy(nn.Linear(2, 1), seen)
    model.compile(optimizer="sgd", loss="mse")
    loader = torch.utils.data.DataLoader(Stream(), batch_size=None)
    recorder = Recorder()
    with pytest.warns(UserWarning, match="ran out of data") as record:
        history = model.fit(loader, epochs=3, steps_per_epoch=7, verbose=0, callbacks=[recorder])
    assert len([w for w in record if "ran out of data" in str(w.message)]) == 1
    # Keras: the epoch ends where the data ends; the next epoch reads a fresh pass.
    assert seen == [0, 1, 2, 3, 4] * 3 and history.epoch == [0, 1, 2]
    # A generator (one pass only): the epochs after it ran out are empty, no StopIteration escapes.
    x, y = ten_batches()
    seen.clear()
    generator = ((torch.from_numpy(x[4 * i:4 * i + 4]), torch.from_numpy(y[4 * i:4 * i + 4])) for i in range(3))
    with pytest.warns(UserWarning, match="ran out of data"):
        model.fit(generator, epochs=2, steps_per_epoch=5, verbose=0)
    assert seen == [0, 1, 2]


def test_infinite_data_without_steps_per_epoch_runs_until_a_callback_stops_training():
    x, y = ten_batches()
    infinite = mf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(4)

    model = linear_model()
    recorder = Recorder()
    history = model.fit(infinite, epochs=3, verbose=0, callbacks=[StopAfterBatch(6), recorder])
    assert recorder.ends == [list(range(7))] and model.optimizer.iterations == 7
    assert history.epoch == [0]


# ---- 3. steps_per_epoch with finite arrays: Keras 3's rule ----------------------------------------
@pytest.mark.parametrize(("steps_per_epoch", "steps_per_execution", "begins", "ends", "batches"), [
    (9, 1, [list(range(9)), [0]] * 2, [list(range(9)), [0]] * 2, [*range(10)] * 2),
    (11, 1, [list(range(10))] * 4, [list(range(10))] * 4, [*range(10)] * 4),
    (9, 3, [[0, 3, 6], [0]] * 2, [[2, 5, 8], [2]] * 2, [*range(10)] * 2),
    (None, 4, [[0, 4, 8]] * 4, [[3, 7, 11]] * 4, [*range(10)] * 4),
])
def test_steps_per_epoch_with_arrays_follows_keras_3(steps_per_epoch, steps_per_execution, begins, ends, batches):
    x, y = ten_batches()
    seen = []
    torch.manual_seed(0)
    model = Spy(nn.Linear(2, 1), seen)
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution)
    recorder = Recorder()
    model.fit(x, y, batch_size=4, epochs=4, steps_per_epoch=steps_per_epoch, shuffle=False, verbose=0,
              callbacks=[recorder])
    assert recorder.begins == begins and recorder.ends == ends
    assert seen == batches  # an epoch ends where the pass ends; the next one starts a new pass


@pytest.mark.parametrize("interrupt_at", [11, 14])
def test_keras_epochs_resume_exactly(tmp_path, interrupt_at):
    """steps_per_epoch=9 over 10 batches (epochs of 9, 1, 9, 1 steps), shuffled: a resume from a
    backup inside the short epoch or inside the next pass trains as the uninterrupted run."""
    x, y = ten_batches()
    arguments = dict(batch_size=4, epochs=4, steps_per_epoch=9, verbose=0)
    reference = linear_model()
    ref_history = reference.fit(x, y, **arguments)
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="Interruption"):
        linear_model().fit(x, y, **arguments, callbacks=[mf.callbacks.BackupAndRestore(backup, save_freq=3),
                                                         InterruptAtStepEnd(interrupt_at)])
    resumed = linear_model()
    seen = []
    spy = mf.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(resumed.loop_state.iterations))
    history = resumed.fit(x, y, **arguments, callbacks=[mf.callbacks.BackupAndRestore(backup, save_freq=3), spy])
    assert history.history == ref_history.history and resumed.optimizer.iterations == 20
    assert seen[-1] == 20
    for a, b in zip(resumed.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


# ---- 4. several inputs ----------------------------------------------------------------------------
class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 1), nn.Linear(2, 1)

    def forward(self, inputs):
        first, second = inputs
        return self.a(first) + self.b(second)


def test_predict_passes_a_list_or_tuple_of_inputs_to_the_module():
    torch.manual_seed(0)
    a, b = np.random.default_rng(0).random((10, 3), "f4"), np.random.default_rng(1).random((10, 2), "f4")
    model = mf.Model(TwoInputs())
    with torch.no_grad():
        expected = model.module((torch.from_numpy(a), torch.from_numpy(b))).numpy()
    np.testing.assert_allclose(model.predict([a, b], batch_size=4, verbose=0), expected, rtol=1e-6)
    np.testing.assert_allclose(model.predict((a, b), batch_size=4, verbose=0), expected, rtol=1e-6)
    model.compile(optimizer="sgd", loss="mse")
    y = np.zeros((10, 1), "f4")
    model.fit([a, b], y, batch_size=4, verbose=0)
    assert model.evaluate((a, b), y, verbose=0) == pytest.approx(float(np.mean(model.predict([a, b], verbose=0) ** 2)),
                                                                  rel=1e-5)


# ---- 5. models without (trainable) parameters -----------------------------------------------------
class SumOfInputs(nn.Module):
    def forward(self, x):
        return x.sum(dim=1, keepdim=True)


@pytest.mark.parametrize("make", [SumOfInputs, lambda: nn.Linear(2, 1).requires_grad_(False)],
                         ids=["no_parameters", "all_frozen"])
def test_models_without_trainable_parameters_predict_evaluate_and_fit_without_update(make):
    x, y = ten_batches()
    torch.manual_seed(0)
    model = mf.Model(make())
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    before = [w.copy() for w in model.get_weights()]
    outputs = model.predict(x, verbose=0)
    assert outputs.shape == (40, *outputs.shape[1:])
    expected = model.evaluate(x, y, batch_size=4, verbose=0, return_dict=True)
    with pytest.warns(UserWarning, match="does not have any trainable weights") as record:
        history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert len([w for w in record if "trainable weights" in str(w.message)]) == 1
    assert history.history["loss"] == [pytest.approx(expected["loss"], rel=1e-6)] * 2
    assert history.history["mae"] == [pytest.approx(expected["mae"], rel=1e-6)] * 2
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)


# ---- 6. train_step / test_step overrides, as Keras's guide -----------------------------------------
def _regression():
    rng = np.random.default_rng(0)
    return rng.random((64, 4), dtype=np.float32), rng.random((64, 1), dtype=np.float32)


def _fit(model_class, **compile_kwargs):
    x, y = _regression()
    torch.manual_seed(0)
    model = model_class(nn.Linear(4, 1))
    model.compile(optimizer=mf.optimizers.SGD(learning_rate=0.1), loss="mse", metrics=["mae"], **compile_kwargs)
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model, history.history


class SuperStep(mf.Model):
    def train_step(self, data):
        logs = super().train_step(data)
        assert set(logs) == {"loss", "mae"} and all(float(v) > 0 for v in logs.values())
        return logs


class GuideStep(mf.Model):
    """The guide's first example: compute_loss, the optimizer, then every metric's update_state."""

    def train_step(self, data):
        x, y = data
        self.optimizer.zero_grad()
        y_pred = self(x, training=True)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        loss.backward()
        self.optimizer.step()
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss.detach())
            else:
                metric.update_state(y, y_pred.detach())
        return {m.name: m.result() for m in self.metrics}


class ComputeMetricsStep(mf.Model):
    """compute_loss and compute_metrics (Keras 3's helpers); the loss tracker updated by hand."""

    def train_step(self, data):
        x, y = data
        self.optimizer.zero_grad()
        y_pred = self(x)
        loss = self.compute_loss(x, y, y_pred)
        loss.backward()
        self.optimizer.step()
        self.metrics[0].update_state(loss.detach())
        return self.compute_metrics(x, y, y_pred, sample_weight=None)


@pytest.mark.parametrize("model_class", [SuperStep, GuideStep, ComputeMetricsStep])
def test_train_step_overrides_log_the_compiled_metrics(model_class):
    reference, expected = _fit(mf.Model)
    model, history = _fit(model_class)
    assert set(history) == set(expected) and all(v > 0 for v in history["mae"])
    for name, values in expected.items():
        assert history[name] == pytest.approx(values, rel=1e-6)
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_test_step_override_returned_dict_is_what_evaluate_returns():
    x, y = _regression()

    class Custom(mf.Model):
        def test_step(self, data):
            x, y = data
            y_pred = self(x, training=False)
            return {"custom": torch.mean(torch.abs(y_pred - y)) * 0 + 1.5}

    class GuideTest(mf.Model):
        def test_step(self, data):
            x, y = data
            y_pred = self(x, training=False)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    models = []
    for cls in (Custom, GuideTest, mf.Model):
        torch.manual_seed(0)
        models.append(cls(nn.Linear(4, 1)))
        models[-1].compile(optimizer="sgd", loss="mse", metrics=["mae"])
    custom, guide, plain = models
    assert custom.evaluate(x, y, verbose=0, return_dict=True) == {"custom": 1.5}
    expected = plain.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    assert guide.evaluate(x, y, batch_size=16, verbose=0, return_dict=True) == pytest.approx(expected)
    assert expected["mae"] > 0


def test_the_customizing_fit_example_runs():
    history = runpy.run_path(str(ROOT / "examples" / "custom_train_step.py"))["main"]()
    assert set(history) == {"loss", "mae"} and history["loss"][-1] < history["loss"][0]
    assert all(v > 0 for v in history["mae"])


# ---- 7. steps_per_execution: nominal indices; evaluate and predict honour it -----------------------
def test_steps_per_execution_in_evaluate_and_predict_uses_keras_indices():
    x, y = ten_batches()
    model = linear_model(steps_per_execution=3)
    hooks = []
    cb = mf.callbacks.LambdaCallback(
        on_test_batch_begin=lambda batch, logs: hooks.append(("test_begin", batch)),
        on_test_batch_end=lambda batch, logs: hooks.append(("test_end", batch)),
        on_predict_batch_begin=lambda batch, logs: hooks.append(("predict_begin", batch)),
        on_predict_batch_end=lambda batch, logs: hooks.append(("predict_end", batch)))
    result = model.evaluate(x, y, batch_size=4, verbose=0, callbacks=[cb])
    assert hooks == [(kind, i) for b, e in ((0, 2), (3, 5), (6, 8), (9, 11))
                     for kind, i in (("test_begin", b), ("test_end", e))]
    assert result == pytest.approx(linear_model().evaluate(x, y, batch_size=4, verbose=0), rel=1e-6)
    hooks.clear()
    outputs = model.predict(x, batch_size=4, verbose=0, callbacks=[cb])
    assert hooks == [(kind, i) for b, e in ((0, 2), (3, 5), (6, 8), (9, 11))
                     for kind, i in (("predict_begin", b), ("predict_end", e))]
    np.testing.assert_allclose(outputs, linear_model().predict(x, batch_size=4, verbose=0), rtol=1e-6)
    hooks.clear()
    model.evaluate(x, y, batch_size=4, steps=5, verbose=0, callbacks=[cb])
    assert hooks == [("test_begin", 0), ("test_end", 2), ("test_begin", 3), ("test_end", 5)]
