"""Keras 3's trainer surface on `mf.Model`: ``run_eagerly``, the ``*_on_batch`` methods, losses and
metrics keyed by output with ``loss_weights``, and metrics tracked as the model's attributes.

Source: keras-team/keras at commit 3422977a5e38fb2f7709aaa9a08e47f0c43d0f60,
keras/src/trainers/trainer_test.py; each test names its case. Assertions and numbers are Keras's;
models are translated (``Dense(3, use_bias=False, kernel_initializer="ones")`` is an
``nn.Linear(4, 3, bias=False)`` filled with ones; a ``keras.Model`` subclass with a ``Dense(2)`` is an
`mf.Model` subclass around ``nn.Linear(4, 2)``). Keras's ``ListOutputModel`` has no output names;
meshfit names a tuple's outputs ``output_0``, ``output_1``, ... in its logs.
The Hugging Face model outputs are in tests/test_model_outputs.py; the 2-worker runs at the end.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf
from tests._multiproc import run_distributed


def _dense(units: int = 3) -> nn.Linear:
    layer = nn.Linear(4, units, bias=False)
    nn.init.ones_(layer.weight)
    return layer


class ExampleModule(nn.Module):
    """trainer_test.py's ExampleModel: one ``Dense(units, use_bias=False, kernel_initializer="ones")``."""

    def __init__(self, units: int = 3) -> None:
        super().__init__()
        self.dense = _dense(units)

    def forward(self, x):
        return self.dense(x)


class StructModule(nn.Module):
    """trainer_test.py's StructModel: a dict in, a dict out."""

    def __init__(self, units: int = 3) -> None:
        super().__init__()
        self.dense_1, self.dense_2 = _dense(units), _dense(units)

    def forward(self, x):
        return {"y_one": self.dense_1(x["x_one"]), "y_two": self.dense_2(x["x_two"])}


class ListOutputModule(nn.Module):
    """trainer_test.py's ListOutputModel: a list of two outputs."""

    def __init__(self, units: int = 3) -> None:
        super().__init__()
        self.dense_1, self.dense_2 = _dense(units), _dense(units)

    def forward(self, x):
        return [self.dense_1(x), self.dense_2(x)]


def _ones(*shape: int) -> np.ndarray:
    return np.ones(shape, "float32")


def _zeros(*shape: int) -> np.ndarray:
    return np.zeros(shape, "float32")


# ---- run_eagerly --------------------------------------------------------------------------------
def test_compile_eager_vs_jit_torch():
    """trainer_test.py::test_compile_eager_vs_jit_torch: ``"auto"`` is eager on torch and run_eagerly False."""
    model = mf.Model(ExampleModule())
    model.compile(jit_compile="auto")
    assert model.run_eagerly is False
    assert model.jit_compile is False


def test_run_eagerly_turns_jit_compile_off():
    """Keras's ``compile``: ``run_eagerly=True`` with ``jit_compile=True`` disables jit_compile, with a
    warning; the setter does the same (trainer_test.py's ``model.run_eagerly = ...`` flows)."""
    model = mf.Model(ExampleModule())
    with pytest.warns(UserWarning, match="run_eagerly"):
        model.compile(optimizer="sgd", loss="mse", run_eagerly=True, jit_compile=True)
    assert model.run_eagerly is True and model.jit_compile is False
    history = model.fit(_ones(8, 4), _zeros(8, 3), batch_size=4, verbose=0)
    assert history.history["loss"][0] > 0
    assert model.placement is not None and not hasattr(model.placement.module, "_orig_mod")  # not compiled
    model.jit_compile = True
    model.run_eagerly = True
    assert model.jit_compile is False
    with pytest.raises(TypeError, match="run_eagerly"):
        model.compile(optimizer="sgd", loss="mse", run_eagerly="yes")


@pytest.mark.parametrize("run_eagerly", [True, False])
def test_predict_flow_struct(run_eagerly):
    """trainer_test.py::test_predict_flow_struct: dict in, dict out, predict returns the dict."""
    model = mf.Model(StructModule())
    model.run_eagerly = run_eagerly
    outputs = model.predict({"x_one": _ones(100, 4), "x_two": _ones(100, 4)}, batch_size=16, verbose=0)
    assert isinstance(outputs, dict) and len(outputs) == 2
    np.testing.assert_allclose(outputs["y_one"], 4 * np.ones((100, 3)))
    np.testing.assert_allclose(outputs["y_two"], 4 * np.ones((100, 3)))


# ---- *_on_batch -------------------------------------------------------------------------------------
@pytest.mark.parametrize("run_eagerly", [True, False])
def test_on_batch_methods(run_eagerly):
    """trainer_test.py::test_on_batch_methods (eager and graph_fn; Keras skips jit on torch)."""
    model = mf.Model(ExampleModule())
    x, y = _ones(100, 4), _zeros(100, 3)
    sw = np.arange(100).reshape((100,)).astype("float32") / 50.0
    model.compile(optimizer=mf.optimizers.SGD(), loss=mf.losses.MeanSquaredError(),
                  metrics=[mf.metrics.MeanSquaredError()], run_eagerly=run_eagerly)
    logs = model.train_on_batch(x, y)
    assert isinstance(logs, list) and len(logs) == 2
    assert logs[0] == pytest.approx(16.0)

    logs = model.train_on_batch(x, y, return_dict=True)
    assert isinstance(logs, dict) and len(logs) == 2
    assert logs["loss"] == pytest.approx(15.158, abs=1e-3)

    logs = model.test_on_batch(x, y)
    assert isinstance(logs, list) and len(logs) == 2
    assert logs[0] == pytest.approx(14.360, abs=1e-3)

    logs = model.test_on_batch(x, y, return_dict=True)
    assert isinstance(logs, dict) and len(logs) == 2
    assert logs["loss"] == pytest.approx(14.360, abs=1e-3)

    output = model.predict_on_batch(x)
    assert isinstance(output, np.ndarray)
    np.testing.assert_allclose(output[0], np.array([3.789511, 3.789511, 3.789511]), rtol=1e-5)

    # With sample weights
    logs = model.train_on_batch(x, y, sw)
    assert logs[0] == pytest.approx(14.217, abs=1e-3)
    logs = model.test_on_batch(x, y, sw)
    assert logs[0] == pytest.approx(13.476, abs=1e-3)
    output = model.predict_on_batch(x)
    np.testing.assert_allclose(output[0], np.array([3.689468, 3.689468, 3.689468]), rtol=1e-5)

    # With class weights
    logs = model.train_on_batch(x, y, class_weight={1: 0.3, 0: 0.2})
    assert logs[0] == pytest.approx(2.722, abs=1e-3)


def test_on_batch_methods_without_training():
    """trainer_test.py::test_on_batch_methods_without_training: compiled without an optimizer."""
    model = mf.Model(ExampleModule())
    x, y = _ones(100, 4), _zeros(100, 3)
    model.compile(loss=mf.losses.MeanSquaredError(), metrics=[mf.metrics.MeanSquaredError()])
    output = model.predict_on_batch(x)
    assert isinstance(output, np.ndarray)
    np.testing.assert_allclose(output[0], np.array([4.0, 4.0, 4.0]))
    logs = model.test_on_batch(x, y)
    assert isinstance(logs, list) and len(logs) == 2
    assert logs[0] == pytest.approx(16.0)
    logs = model.test_on_batch(x, y, return_dict=True)
    assert isinstance(logs, dict) and len(logs) == 2
    assert logs["loss"] == pytest.approx(16.0)


def test_on_batch_methods_refuse_bad_input():
    """meshfit's own: a bad ``return_dict``, class_weight with sample_weight, and no compile are named."""
    model = mf.Model(ExampleModule())
    with pytest.raises(RuntimeError, match="compile"):
        model.train_on_batch(_ones(4, 4), _zeros(4, 3))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(TypeError, match="return_dict"):
        model.train_on_batch(_ones(4, 4), _zeros(4, 3), return_dict="yes")
    with pytest.raises(ValueError, match="class_weight"):
        model.train_on_batch(_ones(4, 4), _zeros(4, 3), sample_weight=np.ones(4), class_weight={0: 1.0})
    dataset = mf.data.Dataset.from_tensor_slices((_ones(4, 4), _zeros(4, 3))).batch(2)
    with pytest.raises(ValueError, match=r"Invalid `x`: expected one batch of arrays.*received x of type Dataset"):
        model.train_on_batch(dataset)


# ---- loss_weights and several outputs -------------------------------------------------------------
def test_loss_weights():
    """trainer_test.py::test_loss_weights: single, dict and list outputs, with Keras's losses per epoch."""
    epochs, batch_size = 3, 20
    dataset_size = batch_size * 2

    # Single output case.
    model = mf.Model(ExampleModule())
    model.compile(optimizer=mf.optimizers.SGD(), loss=mf.losses.MeanSquaredError(),
                  metrics=[mf.metrics.MeanSquaredError()], loss_weights=0.2)
    history = model.fit(_ones(dataset_size, 4), _zeros(dataset_size, 3), batch_size=batch_size, epochs=epochs,
                        verbose=0).history
    assert "loss" in history
    np.testing.assert_allclose(history["loss"], [3.182979, 3.115617, 3.049681], atol=1e-3)

    # Dict output case.
    model = mf.Model(StructModule())
    model.compile(optimizer=mf.optimizers.SGD(),
                  loss={"y_one": mf.losses.MeanSquaredError(), "y_two": mf.losses.MeanSquaredError()},
                  metrics={"y_one": mf.metrics.MeanSquaredError(), "y_two": mf.metrics.MeanSquaredError()},
                  loss_weights={"y_one": 0.1, "y_two": 0.2})
    x = {"x_one": _ones(dataset_size, 4), "x_two": _ones(dataset_size, 4)}
    y = {"y_one": _zeros(dataset_size, 3), "y_two": _zeros(dataset_size, 3)}
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0).history
    assert "loss" in history
    np.testing.assert_allclose(history["loss"], [4.778718, 4.694403, 4.611693], atol=1e-3)
    # Keras 3's names: each output's unweighted loss and its metrics, prefixed by the output's name
    assert {"y_one_loss", "y_two_loss", "y_one_mean_squared_error", "y_two_mean_squared_error"} <= set(history)
    np.testing.assert_allclose(np.array(history["y_one_loss"]) * 0.1 + np.array(history["y_two_loss"]) * 0.2,
                               history["loss"], rtol=1e-5)

    # List output case.
    model = mf.Model(ListOutputModule())
    model.compile(optimizer=mf.optimizers.SGD(), loss=[mf.losses.MeanSquaredError(), mf.losses.MeanSquaredError()],
                  metrics=[mf.metrics.MeanSquaredError(), mf.metrics.MeanSquaredError()], loss_weights=[0.1, 0.2])
    history = model.fit(_ones(dataset_size, 4), [_zeros(dataset_size, 3), _zeros(dataset_size, 3)],
                        batch_size=batch_size, epochs=epochs, verbose=0).history
    assert "loss" in history
    np.testing.assert_allclose(history["loss"], [4.778718, 4.694403, 4.611693], atol=1e-3)
    assert {"output_0_loss", "output_1_loss"} <= set(history)


def test_partial_loss_partial_label():
    """trainer_test.py::test_partial_loss_partial_label: ``["mse", None, None]`` with one target."""
    class Three(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = nn.Linear(2, 3)
            nn.init.ones_(self.dense.weight)
            nn.init.zeros_(self.dense.bias)

        def forward(self, x):
            out = self.dense(x)
            return [out, out, out]

    partial_model, full_model = mf.Model(Three()), mf.Model(Three())
    partial_model.compile(loss=["mse", None, None])
    full_model.compile(loss=["mse", "mse", "mse"])
    eval_x, eval_y = _ones(32, 2), _ones(32, 3)
    partial_logs = partial_model.evaluate(eval_x, eval_y, return_dict=True, verbose=0)
    logs = full_model.evaluate(eval_x, [eval_y] * 3, return_dict=True, verbose=0)
    assert partial_logs["loss"] * 3 == pytest.approx(logs["loss"])


def test_a_list_of_one_loss_for_the_one_output():
    """Keras's single-output form of the lists: ``loss=["mse"]``, ``loss_weights=[0.5]``, targets ``[y]``."""
    model = mf.Model(ExampleModule())
    model.compile(optimizer=mf.optimizers.SGD(), loss=["mse"], loss_weights=[0.5], metrics=["mse"])
    logs = model.test_on_batch(_ones(8, 4), [_zeros(8, 3)], return_dict=True)
    assert logs == pytest.approx({"loss": 8.0, "mse": 16.0})  # one loss: no output_0_loss
    assert model.train_on_batch(_ones(8, 4), _zeros(8, 3))[0] == pytest.approx(8.0)


def test_evaluate_and_on_batch_with_dict_outputs():
    """The dict losses hold for evaluate, the *_on_batch methods and predict's structure too (Keras)."""
    model = mf.Model(StructModule())
    model.compile(optimizer=mf.optimizers.SGD(), loss={"y_one": "mse", "y_two": "mse"},
                  loss_weights={"y_one": 0.1, "y_two": 0.2})
    x = {"x_one": _ones(20, 4), "x_two": _ones(20, 4)}
    y = {"y_one": _zeros(20, 3), "y_two": _zeros(20, 3)}
    logs = model.test_on_batch(x, y, return_dict=True)
    assert logs == pytest.approx({"loss": 16 * 0.3, "y_one_loss": 16.0, "y_two_loss": 16.0})
    logs = model.train_on_batch(x, y, return_dict=True)
    assert logs["loss"] == pytest.approx(4.8)
    out = model.predict_on_batch(x)
    assert sorted(out) == ["y_one", "y_two"] and out["y_one"].shape == (20, 3)
    # y_one's gradient is half of y_two's: 0.1 vs 0.2
    assert 4 - out["y_one"][0, 0] == pytest.approx((4 - out["y_two"][0, 0]) / 2, rel=1e-4)


def test_bad_loss_structure_is_refused_by_name():
    """meshfit's own: a loss dict naming an output the model does not produce, ``loss_weights`` of
    another length or keys, and a metrics dict without a keyed loss name the values and the fix."""
    x = {"x_one": _ones(8, 4), "x_two": _ones(8, 4)}
    y = {"y_one": _zeros(8, 3), "y_two": _zeros(8, 3)}
    model = mf.Model(StructModule())
    model.compile(optimizer="sgd", loss={"y_one": "mse", "y_three": "mse"})
    with pytest.raises(ValueError, match=r"'y_three', which the model does not produce.*\['y_one', 'y_two'\]"):
        model.fit(x, y, verbose=0)
    with pytest.raises(ValueError, match=r"expected 2 weight\(s\).*received 3.*loss_weights=\[1, 2, 3\]"):
        model.compile(optimizer="sgd", loss={"y_one": "mse", "y_two": "mse"}, loss_weights=[1, 2, 3])
    with pytest.raises(ValueError, match=r"keys \['y_one', 'y_3'\] must be the loss dict's output names "
                                         r"\['y_one', 'y_two'\]"):
        model.compile(optimizer="sgd", loss={"y_one": "mse", "y_two": "mse"}, loss_weights={"y_one": 1, "y_3": 2})
    with pytest.raises(ValueError, match=r"one number for 2 losses"):
        model.compile(optimizer="sgd", loss=["mse", "mse"], loss_weights=0.5)
    with pytest.raises(ValueError, match=r"names output\(s\) \['y_3'\] that have no loss"):
        model.compile(optimizer="sgd", loss={"y_one": "mse"}, metrics={"y_3": ["mse"]})
    with pytest.raises(ValueError, match="one loss for a model that returns a dict with outputs"):
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, verbose=0)
    with pytest.raises(ValueError, match=r"a list of 3 losses, but the model returns a list of 2 outputs"):
        lists = mf.Model(ListOutputModule())
        lists.compile(optimizer="sgd", loss=["mse", "mse", "mse"])
        lists.fit(_ones(8, 4), [_zeros(8, 3)] * 3, verbose=0)


# ---- metrics tracked as attributes ------------------------------------------------------------------
class _ComputeLossMetricModel(mf.Model):
    """trainer_test.py's MyModel of the compute_loss cases: a metric attribute updated in compute_loss."""

    def __init__(self, expect_training: bool | None = None, with_training: bool = True) -> None:
        super().__init__(nn.Linear(4, 2))
        self.custom_metric = mf.metrics.Mean(name="custom")
        self.expect_training = expect_training
        self.trainings: list[bool] = []

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        self.trainings.append(training)
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        self.custom_metric.update_state(loss * 4)
        return loss


class _NoTrainingArgModel(mf.Model):
    """trainer_test.py::test_compute_loss_no_training_backwards_compatibility's MyModel."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(4, 2))
        self.custom_metric = mf.metrics.Mean(name="custom")

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
        loss = super().compute_loss(x, y, y_pred, sample_weight)
        self.custom_metric.update_state(loss * 4)
        return loss


def test_metric_tracking():
    """trainer_test.py::test_metric_tracking: the loss tracker, the compiled metric, then the attribute."""
    class ModelWithMetric(mf.Model):
        def __init__(self) -> None:
            super().__init__(ExampleModule())
            self.my_metric = mf.metrics.MeanSquaredError(name="my_metric")

    model = ModelWithMetric()
    model.compile(optimizer=mf.optimizers.SGD(), loss=mf.losses.MeanSquaredError(),
                  metrics=[mf.metrics.MeanSquaredError()])
    model.fit(_ones(2, 4), _zeros(2, 3), batch_size=2, epochs=1, verbose=0)
    assert len(model.metrics) == 3
    assert model.metrics[0] is model._loss_tracker
    assert model.metrics[1] is model._compiled_metrics[0]
    assert model.metrics[2] is model.my_metric


def test_metric_update_in_compute_loss():
    """trainer_test.py::test_metric_update_in_compute_loss: logged by fit, training=True."""
    model = _ComputeLossMetricModel()
    torch.manual_seed(0)
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(_ones(32, 4), _ones(32, 2) * 2, verbose=0)
    assert history.history["custom"][0] == pytest.approx(history.history["loss"][0] * 4, rel=1e-6)
    assert model.trainings and all(model.trainings)


def test_evaluate_with_custom_compute_loss():
    """trainer_test.py::test_evaluate_with_custom_compute_loss: evaluate calls it with training=False."""
    model = _ComputeLossMetricModel()
    model.compile(optimizer="sgd", loss="mse")
    logs = model.evaluate(_ones(32, 4), _ones(32, 2) * 2, return_dict=True, verbose=0)
    assert logs["custom"] == pytest.approx(logs["loss"] * 4, rel=1e-6)
    assert model.trainings and not any(model.trainings)


def test_compute_loss_no_training_backwards_compatibility():
    """trainer_test.py::test_compute_loss_no_training_backwards_compatibility: an override without
    ``training`` still works in evaluate and fit."""
    model = _NoTrainingArgModel()
    model.compile(optimizer="sgd", loss="mse")
    logs = model.evaluate(_ones(32, 4), _ones(32, 2) * 2, return_dict=True, verbose=0)
    assert logs["custom"] == pytest.approx(logs["loss"] * 4, rel=1e-6)
    history = model.fit(_ones(32, 4), _ones(32, 2) * 2, verbose=0)
    assert history.history["custom"][0] == pytest.approx(history.history["loss"][0] * 4, rel=1e-6)


# ---- under MultiWorkerMirroredStrategy (2 gloo workers) --------------------------------------------
def _on_batch_and_dict_losses() -> dict:
    """The *_on_batch methods and a dict of weighted losses, run under whatever scope is current."""
    torch.manual_seed(0)
    model = mf.Model(ExampleModule())
    x, y = _ones(100, 4), _zeros(100, 3)
    sw = np.arange(100).astype("float32") / 50.0
    model.compile(optimizer=mf.optimizers.SGD(), loss=mf.losses.MeanSquaredError(),
                  metrics=[mf.metrics.MeanSquaredError()])
    on_batch = [model.train_on_batch(x, y), model.train_on_batch(x, y, sw, return_dict=True),
                model.test_on_batch(x, y, sw), model.train_on_batch(x, y, class_weight={0: 0.2}),
                model.predict_on_batch(x)[0].tolist()]
    struct = mf.Model(StructModule())
    struct.compile(optimizer=mf.optimizers.SGD(), loss={"y_one": "mse", "y_two": "mse"},
                   metrics={"y_one": ["mae"]}, loss_weights={"y_one": 0.1, "y_two": 0.2})
    data = ({"x_one": _ones(40, 4), "x_two": _ones(40, 4) * np.arange(40, dtype="float32")[:, None] / 40},
            {"y_one": _zeros(40, 3), "y_two": _zeros(40, 3)})
    history = struct.fit(*data, batch_size=20, epochs=2, verbose=0, shuffle=False).history
    step = struct.train_on_batch(*data, return_dict=True)
    return {"on_batch": on_batch, "history": history, "step": step,
            "weights": [w.tolist() for w in struct.get_weights()]}


def _worker(rank: int, world: int) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with mf.MultiWorkerMirroredStrategy().scope():
            return _on_batch_and_dict_losses()


@pytest.mark.timeout(300)
def test_on_batch_and_dict_losses_on_two_workers_equal_one_process():
    """Keras's numbers above, and the dict losses' logs and weights, on 2 workers equal one process:
    each worker takes half of the batch, and the gradients and logs are reduced over both."""
    single = _on_batch_and_dict_losses()
    assert single["on_batch"][0] == pytest.approx([16.0, 16.0])  # trainer_test.py::test_on_batch_methods
    assert single["on_batch"][1]["loss"] == pytest.approx(15.158 * 0.99, abs=1e-3)
    results = run_distributed(_worker, world_size=2, timeout=240)
    for result in results:
        for got, want in zip(result["on_batch"], single["on_batch"], strict=True):
            if isinstance(want, dict):
                assert got == pytest.approx(want, rel=1e-5)
            else:
                np.testing.assert_allclose(got, want, rtol=1e-5)
        assert result["history"].keys() == single["history"].keys()
        assert {"y_one_loss", "y_two_loss", "y_one_mae"} <= set(result["history"])
        for name, values in single["history"].items():
            np.testing.assert_allclose(result["history"][name], values, rtol=1e-5)
        assert result["step"] == pytest.approx(single["step"], rel=1e-5)
        for got, want in zip(result["weights"], single["weights"], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
