"""Losses, ``loss_weights`` and metrics keyed by output survive ``model.save`` / ``mf.load_model``: the
loaded model is compiled again with the same keyed losses, weights and metrics, as Keras 3 recompiles a
``.keras`` file from its compile config (``loss``, ``loss_weights``, ``metrics`` in the shapes compile
took them; `CompileLoss.get_config`).

The models and numbers of the first two tests are keras-team/keras's at commit
3422977a5e38fb2f7709aaa9a08e47f0c43d0f60, keras/src/trainers/trainer_test.py::test_loss_weights (its
dict and list output cases, 3 epochs): here the first epoch runs before the save, the other two after the
load, and Keras's per-epoch losses hold across it.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from torch import nn

import meshfit as mf
from tests.test_keras3_trainer import ListOutputModule, StructModule, _ones, _zeros
from tests.test_model_outputs import ModelOutput

EPOCHS, BATCH, SIZE = 3, 20, 40


def _saved_compile(path: str) -> dict:
    if path.endswith(".keras"):
        import zipfile

        with zipfile.ZipFile(path) as archive:
            return json.loads(archive.read("config.json"))["compile"]
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f)["compile"]


def test_dict_losses_weights_and_metrics_are_recompiled_by_load_model(tmp_path):
    """trainer_test.py::test_loss_weights, dict output case: epoch 1, save (.keras), load, epochs 2-3."""
    model = mf.Model(StructModule())
    model.compile(optimizer=mf.optimizers.SGD(),
                  loss={"y_one": mf.losses.MeanSquaredError(), "y_two": mf.losses.MeanSquaredError()},
                  metrics={"y_one": mf.metrics.MeanSquaredError(), "y_two": [mf.metrics.MeanSquaredError(), "mae"]},
                  loss_weights={"y_one": 0.1, "y_two": 0.2})
    x = {"x_one": _ones(SIZE, 4), "x_two": _ones(SIZE, 4)}
    y = {"y_one": _zeros(SIZE, 3), "y_two": _zeros(SIZE, 3)}
    first = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0).history
    path = str(tmp_path / "struct.keras")
    model.save(path)

    saved = _saved_compile(path)
    assert saved["loss"] == {"y_one": mf.losses.serialize("mse"), "y_two": mf.losses.serialize("mse")}
    assert saved["loss_weights"] == {"y_one": 0.1, "y_two": 0.2}
    assert list(saved["metrics"]) == ["y_one", "y_two"] and saved["metrics"]["y_two"][1] == "mae"

    loaded = mf.load_model(path, module=StructModule())
    assert loaded.compiled
    assert loaded.evaluate(x, y, return_dict=True, verbose=0) == pytest.approx(
        model.evaluate(x, y, return_dict=True, verbose=0), rel=1e-6)
    rest = loaded.fit(x, y, batch_size=BATCH, epochs=EPOCHS - 1, verbose=0).history
    np.testing.assert_allclose(first["loss"] + rest["loss"], [4.778718, 4.694403, 4.611693], atol=1e-3)
    assert set(rest) == {"loss", "y_one_loss", "y_two_loss", "y_one_mean_squared_error",
                         "y_two_mean_squared_error", "y_two_mae"}
    np.testing.assert_allclose(np.array(rest["y_one_loss"]) * 0.1 + np.array(rest["y_two_loss"]) * 0.2,
                               rest["loss"], rtol=1e-5)


def test_list_losses_weights_and_metrics_are_recompiled_by_load_model(tmp_path):
    """trainer_test.py::test_loss_weights, list output case, saved as a directory; one metric per output."""
    model = mf.Model(ListOutputModule())
    model.compile(optimizer=mf.optimizers.SGD(), loss=[mf.losses.MeanSquaredError(), "mse"],
                  metrics=[mf.metrics.MeanSquaredError(), ["mae"]], loss_weights=[0.1, 0.2])
    x, y = _ones(SIZE, 4), [_zeros(SIZE, 3), _zeros(SIZE, 3)]
    first = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0).history
    path = str(tmp_path / "listed")
    model.save(path)
    assert _saved_compile(path)["loss_weights"] == [0.1, 0.2]

    loaded = mf.load_model(path, module=ListOutputModule())
    assert loaded.evaluate(x, y, return_dict=True, verbose=0) == pytest.approx(
        model.evaluate(x, y, return_dict=True, verbose=0), rel=1e-6)
    rest = loaded.fit(x, y, batch_size=BATCH, epochs=EPOCHS - 1, verbose=0).history
    np.testing.assert_allclose(first["loss"] + rest["loss"], [4.778718, 4.694403, 4.611693], atol=1e-3)
    assert set(rest) == {"loss", "output_0_loss", "output_1_loss", "output_0_mean_squared_error",
                         "output_1_mae"}


class _Heads(nn.Module):
    """A ``ModelOutput`` with logits and hidden states, its ``attentions`` None (absent)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        hidden = self.body(x)
        return ModelOutput(logits=self.head(hidden), hidden_states=hidden, attentions=None)


def test_a_model_output_with_a_partial_list_and_a_single_weighted_loss_round_trip(tmp_path):
    """``loss={"logits": ...}`` with a metric on a ModelOutput; ``["mse", None]`` (a partial list) and a
    single loss with ``loss_weights=0.5``: each recompiled as compiled, evaluate equal."""
    x = np.random.RandomState(1).randn(16, 4).astype("float32")
    labels = np.random.RandomState(2).randint(0, 3, 16)
    cases = [
        (_Heads, {"loss": {"logits": mf.losses.SparseCategoricalCrossentropy(from_logits=True)},
                  "metrics": {"logits": ["accuracy"]}}, labels),
        (ListOutputModule, {"loss": ["mse", None], "loss_weights": [0.5, 1.0]}, _zeros(16, 3)),
        (lambda: nn.Linear(4, 3), {"loss": "mse", "loss_weights": 0.5, "metrics": ["mae"]}, _zeros(16, 3)),
    ]
    for i, (build, arguments, y) in enumerate(cases):
        model = mf.Model(build())
        model.compile(optimizer=mf.optimizers.Adam(0.01), **arguments)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        path = str(tmp_path / f"case{i}.keras")
        model.save(path)
        loaded = mf.load_model(path, module=build())
        assert type(loaded.loss) is type(model.loss)
        assert loaded.evaluate(x, y, return_dict=True, verbose=0) == pytest.approx(
            model.evaluate(x, y, return_dict=True, verbose=0), rel=1e-6)
        # the optimizer's state came back too: one more step lands on the same weights
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        loaded.fit(x, y, batch_size=16, epochs=1, verbose=0)
        for got, want in zip(loaded.get_weights(), model.get_weights(), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_a_keyed_function_loss_is_not_recompiled(tmp_path):
    """A loss given as a function cannot be rebuilt from JSON: as with one such loss, the model loads
    uncompiled (its weights restored) and is compiled again by the caller."""
    model = mf.Model(_Heads())
    model.compile(optimizer="sgd", loss={"logits": lambda y_true, y_pred: (y_pred - y_true).square().mean()})
    model.build(_ones(2, 4))
    path = str(tmp_path / "function.keras")
    model.save(path)
    assert _saved_compile(path)["loss"] is None
    loaded = mf.load_model(path, module=_Heads())
    assert not loaded.compiled
    for got, want in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)


# ---- Keras 3's CompileLoss cases ------------------------------------------------------------------
# keras-team/keras at commit 012a78760fac9de457afc110903c6eb12bcc6feb, keras/src/trainers/compile_utils_test.py,
# class TestCompileLoss; numbers are Keras's. Its broadcast variants (one loss for every output) are
# refused by meshfit on purpose (see tests/test_keras3_trainer.py::test_bad_loss_structure_is_refused_by_name).
_A_TRUE = np.array([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]], "float32")
_B_TRUE = np.array([[0.7, 0.8], [0.9, 1.0], [1.1, 1.2]], "float32")
_A_PRED = np.array([[1.2, 1.1], [1.0, 0.9], [0.8, 0.7]], "float32")
_B_PRED = np.array([[0.6, 0.5], [0.4, 0.3], [0.2, 0.1]], "float32")


def _t(*arrays):
    import torch

    return [torch.from_numpy(a) for a in arrays]


def _ab(a, b):
    """``{"a": a, "b": b}`` as torch tensors."""
    first, second = _t(a, b)
    return {"a": first, "b": second}


def _round_trip(compile_loss):
    """The CompileLoss rebuilt from its config through JSON, as load_model rebuilds it."""
    from meshfit._engine._outputs import CompileLoss

    config = json.loads(json.dumps(compile_loss.get_config()))
    return CompileLoss(config["loss"], config["loss_weights"])


def test_compile_loss_single_output_case():
    """compile_utils_test.py::TestCompileLoss::test_single_output_case (and its config round trip)."""
    from meshfit._engine._outputs import CompileLoss

    y_true, y_pred = _t(_A_TRUE, np.array([[0.4, 0.1], [0.2, 0.6], [0.6, 0.1]], "float32"))
    compile_loss = CompileLoss(mf.losses.MeanSquaredError())
    for loss in (compile_loss, _round_trip(compile_loss)):
        assert float(loss(y_true, y_pred)) == pytest.approx(0.068333, abs=1e-5)


def test_compile_loss_list_output_case():
    """compile_utils_test.py::TestCompileLoss::test_list_output_case (broadcast=False)."""
    from meshfit._engine._outputs import CompileLoss

    compile_loss = CompileLoss(["mse", "mse"])
    for loss in (compile_loss, _round_trip(compile_loss)):
        assert float(loss(_t(_A_TRUE, _B_TRUE), _t(_A_PRED, _B_PRED))) == pytest.approx(0.953333, abs=1e-5)


def test_compile_loss_dict_output_case():
    """compile_utils_test.py::TestCompileLoss::test_dict_output_case (broadcast=False): sample weights keyed
    by output."""
    from meshfit._engine._outputs import CompileLoss

    y_true, y_pred = _ab(_A_TRUE, _B_TRUE), _ab(_A_PRED, _B_PRED)
    sample_weight = _ab(np.array([1.0, 2.0, 3.0], "float32"), np.array([3.0, 2.0, 1.0], "float32"))
    compile_loss = CompileLoss({"a": "mse", "b": "mse"})
    for loss in (compile_loss, _round_trip(compile_loss)):
        assert float(loss(y_true, y_pred, sample_weight)) == pytest.approx(1.266666, abs=1e-5)


def test_compile_loss_struct_loss_valid_weights():
    """compile_utils_test.py::TestCompileLoss::test_struct_loss_valid_weights, its weights as numbers (Keras
    passes arrays of ones and zeros): the total weighs, the per-output trackers stay unweighted."""
    from meshfit._engine._outputs import CompileLoss

    y_true = _ab(np.array([1.0, 2.0], "float32"), np.array([1.0, 2.0], "float32"))
    y_pred = _ab(np.array([3.0, 4.0], "float32"), np.array([3.0, 4.0], "float32"))
    original = CompileLoss({"a": "mse", "b": "mse"}, loss_weights={"a": 1.0, "b": 0.0})
    assert original.get_config()["loss_weights"] == {"a": 1.0, "b": 0.0}
    for loss in (original, _round_trip(original)):
        assert float(loss(y_true, y_pred)) == pytest.approx(4.0)
        a_loss_mean, b_loss_mean = loss.metrics
        assert float(a_loss_mean.result()) == 4.0 and float(b_loss_mean.result()) == 4.0


@pytest.mark.parametrize("loss_conf", [["mse", None, None], [None, "mse", None], [None, None, "mse"],
                                       [None, "mse", "mse"], ["mse", None, "mse"]])
def test_compile_loss_y_true_partial_y_pred_span(loss_conf):
    """compile_utils_test.py::TestCompileLoss::test_y_true_partial_y_pred_span: targets for the outputs
    with a loss only (one tensor when one has a loss); the config keeps the None entries."""
    from meshfit._engine._outputs import CompileLoss

    y_pred = _t(np.zeros((320, 3), "float32"), np.ones((320, 3), "float32"), np.full((320, 3), 2.0, "float32"))
    y_true = [y for y, loss in zip(y_pred, loss_conf, strict=True) if loss is not None]
    y_true = y_true[0] if len(y_true) == 1 else y_true
    compile_loss = CompileLoss(loss_conf)
    assert [entry is None for entry in compile_loss.get_config()["loss"]] == [c is None for c in loss_conf]
    for loss in (compile_loss, _round_trip(compile_loss)):
        assert float(loss(y_true, y_pred)) == 0.0
