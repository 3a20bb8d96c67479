"""Losses: Keras values, sample weights, reductions, resolution and serialisation."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshfit as mf
from meshfit.losses import (
    BinaryCrossentropy,
    CategoricalCrossentropy,
    Huber,
    Loss,
    MeanAbsoluteError,
    MeanSquaredError,
    SparseCategoricalCrossentropy,
    deserialize,
    get,
    serialize,
)

PROBS = torch.tensor([[0.9, 0.1], [0.2, 0.8]])


def test_sparse_categorical_crossentropy_on_probabilities():
    loss = SparseCategoricalCrossentropy()(torch.tensor([0, 1]), PROBS)
    assert loss.ndim == 0
    assert loss.item() == pytest.approx(-(math.log(0.9) + math.log(0.8)) / 2, rel=1e-6)


def test_sparse_categorical_crossentropy_accepts_column_labels_and_float_labels():
    expected = SparseCategoricalCrossentropy()(torch.tensor([0, 1]), PROBS)
    assert torch.allclose(SparseCategoricalCrossentropy()(torch.tensor([[0], [1]]), PROBS), expected)
    assert torch.allclose(SparseCategoricalCrossentropy()(torch.tensor([0.0, 1.0]), PROBS), expected)


def test_probabilities_are_clamped_so_zero_probability_is_finite():
    loss = SparseCategoricalCrossentropy()(torch.tensor([1]), torch.tensor([[1.0, 0.0]]))
    assert loss.item() == pytest.approx(-math.log(1e-7), rel=1e-4)
    bce = BinaryCrossentropy()(torch.tensor([1.0]), torch.tensor([0.0]))
    assert math.isfinite(bce.item())


def test_sparse_categorical_crossentropy_from_logits_matches_torch_and_backprops():
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.1, 0.2, 3.0]], requires_grad=True)
    labels = torch.tensor([2, 0])
    loss = SparseCategoricalCrossentropy(from_logits=True)(labels, logits)
    assert torch.allclose(loss, F.cross_entropy(logits, labels))
    loss.backward()
    assert logits.grad is not None


def test_sparse_categorical_crossentropy_mean_of_logits_is_the_per_sample_path_in_one_kernel():
    # (batch, classes) logits, int64 labels, no weights: torch's mean cross-entropy, the same loss and
    # gradient as the per-sample losses' sum over the batch size (to float rounding), for any batch.
    torch.manual_seed(0)
    loss = SparseCategoricalCrossentropy(from_logits=True)
    for rows in (1, 7, 32):
        logits = torch.randn(rows, 5, requires_grad=True)
        labels = torch.randint(0, 5, (rows,))
        fast = loss(labels, logits)
        fast_grad, = torch.autograd.grad(fast, logits)
        general = loss.call(labels, logits).sum() / rows
        general_grad, = torch.autograd.grad(general, logits)
        torch.testing.assert_close(fast, general, rtol=1e-6, atol=0)
        torch.testing.assert_close(fast_grad, general_grad, rtol=1e-6, atol=1e-9)
    # Every label counts (torch's ignore_index of -100 skips none), as in Keras: -100 is out of range, and
    # so is what a NaN or an overflowing float label becomes as int64, on either path.
    broken = int(torch.tensor([float("nan")]).long())
    for bad in (-100, broken, -(2**63), 2**63 - 1):
        for labels in (torch.tensor([1, bad]), torch.tensor([[1], [bad]])):
            with pytest.raises(IndexError, match=rf"{bad} is out of bounds.* takes labels in \[0, 5\).*ignore_class"):
                loss(labels, torch.randn(2, 5))


def test_sparse_categorical_crossentropy_ignore_class_follows_keras_3():
    # Keras 3's losses_test.py (3422977a): test_ignore_class, with reduction=None spelled "none".
    logits = torch.tensor([[[0.854, 0.698, 0.598], [0.088, 0.86, 0.018]]], dtype=torch.float64)
    for y_true in (torch.tensor([[-1, 2]]), torch.tensor([[[-1], [2]]])):
        loss = SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1, reduction="none")(y_true, logits)
        torch.testing.assert_close(loss, torch.tensor([[0.0, 1.480129]], dtype=torch.float64), rtol=1e-5, atol=1e-6)
    # ... and test_config.
    config = SparseCategoricalCrossentropy(from_logits=True, ignore_class=3, axis=0, name="scce").get_config()
    assert (config["from_logits"], config["ignore_class"], config["axis"]) == (True, 3, 0)
    assert SparseCategoricalCrossentropy.from_config(config).ignore_class == 3
    # The mean counts the labels that count (Keras divides by their number + epsilon): torch's ignore_index
    # convention on a language model's (batch, seq, vocab) logits with -100 padding, to float rounding.
    torch.manual_seed(0)
    scores = torch.randn(2, 5, 7, requires_grad=True)
    labels = torch.randint(0, 7, (2, 5))
    labels[0, 3:] = -100
    mean = SparseCategoricalCrossentropy(from_logits=True, ignore_class=-100)(labels, scores)
    torch.testing.assert_close(mean, F.cross_entropy(scores.reshape(-1, 7), labels.reshape(-1), ignore_index=-100))
    grad, = torch.autograd.grad(mean, scores)
    assert torch.count_nonzero(grad[0, 3:]) == 0  # the padding learns nothing
    weights = torch.rand(2, 5)
    weighted = SparseCategoricalCrossentropy(from_logits=True, ignore_class=-100)(labels, scores, sample_weight=weights)
    per_label = F.cross_entropy(scores.reshape(-1, 7), labels.reshape(-1), ignore_index=-100, reduction="none")
    torch.testing.assert_close(weighted, (per_label * weights.reshape(-1)).sum() / 8)
    # On probabilities too; every label ignored gives 0, not NaN.
    probs = torch.softmax(torch.randn(3, 4), dim=-1)
    ignored = SparseCategoricalCrossentropy(ignore_class=2)
    torch.testing.assert_close(ignored(torch.tensor([2, 1, 0]), probs),
                               -(probs[1, 1].log() + probs[2, 0].log()) / 2, rtol=1e-5, atol=0)
    assert ignored(torch.tensor([2, 2, 2]), probs).item() == 0.0
    with pytest.raises(TypeError, match="Invalid `ignore_class`"):
        SparseCategoricalCrossentropy(ignore_class="-100")
    with pytest.raises(TypeError, match="Invalid `ignore_class`"):
        SparseCategoricalCrossentropy(ignore_class=True)


def test_sparse_categorical_crossentropy_ignore_class_mean_is_exact_and_axis_1_labels_squeeze():
    # The mean divides by the exact count of the labels that count (Keras's divide_no_nan, torch's ignore_index
    # mean), in the loss's dtype.
    torch.manual_seed(0)
    logits = torch.randn(4, 3, dtype=torch.float64)
    labels = torch.tensor([2, -100, -100, -100])
    loss = SparseCategoricalCrossentropy(from_logits=True, ignore_class=-100)(labels, logits)
    assert loss.dtype is torch.float64
    torch.testing.assert_close(loss, F.cross_entropy(logits, labels, ignore_index=-100), rtol=1e-12, atol=0.0)
    # Keras squeezes a size-1 label dim at `axis`: torch's (n, 1, H, W) labels for (n, classes, H, W) scores.
    scores = torch.randn(2, 4, 3, 5)
    columns = torch.randint(0, 4, (2, 1, 3, 5))
    for ignore_class in (None, 0):
        loss = SparseCategoricalCrossentropy(from_logits=True, axis=1, ignore_class=ignore_class)(columns, scores)
        expected = F.cross_entropy(scores, columns.squeeze(1), ignore_index=-100 if ignore_class is None else 0)
        torch.testing.assert_close(loss, expected)
    # A label out of range besides the ignored one is an error that says which is left out.
    with pytest.raises(IndexError, match=r"Target 7 is out of bounds.*leaves out ignore_class=-100 only"):
        SparseCategoricalCrossentropy(from_logits=True, ignore_class=-100)(torch.tensor([7, -100]), logits[:2])


def test_sparse_categorical_crossentropy_axis_1_for_torch_layout():
    logits = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[0, 1, 2, 0], [2, 2, 1, 0]])
    loss = SparseCategoricalCrossentropy(from_logits=True, axis=1)(labels, logits)
    assert torch.allclose(loss, F.cross_entropy(logits, labels))


def test_sparse_categorical_crossentropy_on_sequence_logits_is_per_position_and_weights_each_sequence():
    # (batch, seq, classes) with classes last, as a language model outputs them: read as rows, the same
    # per-position losses and gradients as torch's cross_entropy with the classes moved to dim 1
    logits = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(1), requires_grad=True)
    labels = torch.randint(0, 7, (3, 5), generator=torch.Generator().manual_seed(2))
    want = F.cross_entropy(logits.movedim(-1, 1), labels, reduction="none")
    per_position = SparseCategoricalCrossentropy(from_logits=True, reduction="none")(labels, logits)
    assert per_position.shape == (3, 5)
    torch.testing.assert_close(per_position, want)
    weight = torch.tensor([1.0, 0.0, 2.0])  # one weight per sequence: broadcast over its positions
    loss = SparseCategoricalCrossentropy(from_logits=True)(labels[..., None], logits, sample_weight=weight)
    torch.testing.assert_close(loss, (want * weight[:, None]).sum() / 15)
    (grad,) = torch.autograd.grad(loss, logits)
    (expected,) = torch.autograd.grad((want * weight[:, None]).sum() / 15, logits)
    torch.testing.assert_close(grad, expected)
    probs = logits.detach().softmax(-1)
    torch.testing.assert_close(SparseCategoricalCrossentropy(reduction="none")(labels, probs), want.detach())
    with pytest.raises(ValueError, match="batch_size"):  # labels of another shape are not flattened into rows
        SparseCategoricalCrossentropy(from_logits=True)(labels.T.contiguous(), logits)


def test_categorical_crossentropy_with_label_smoothing():
    one_hot = torch.tensor([[1.0, 0.0]])
    pred = torch.tensor([[0.7, 0.3]])
    assert CategoricalCrossentropy()(one_hot, pred).item() == pytest.approx(-math.log(0.7), rel=1e-6)
    smoothed = CategoricalCrossentropy(label_smoothing=0.2)(one_hot, pred).item()
    assert smoothed == pytest.approx(-(0.9 * math.log(0.7) + 0.1 * math.log(0.3)), rel=1e-6)


def test_categorical_crossentropy_from_logits():
    logits = torch.tensor([[1.0, 2.0, 0.0]])
    loss = CategoricalCrossentropy(from_logits=True)(torch.tensor([[0.0, 1.0, 0.0]]), logits)
    assert torch.allclose(loss, F.cross_entropy(logits, torch.tensor([1])))


def test_binary_crossentropy_probabilities_and_logits():
    y = torch.tensor([[1.0], [0.0]])
    loss = BinaryCrossentropy()(y, torch.tensor([[0.8], [0.4]]))
    assert loss.item() == pytest.approx(-(math.log(0.8) + math.log(0.6)) / 2, rel=1e-6)
    logits = torch.tensor([[1.5], [-0.3]])
    expected = F.binary_cross_entropy_with_logits(logits, y)
    assert torch.allclose(BinaryCrossentropy(from_logits=True)(y, logits), expected)


def test_column_predictions_do_not_broadcast_against_flat_labels():
    y_true = torch.tensor([1.0, 2.0, 3.0])
    y_pred = torch.tensor([[1.0], [2.0], [5.0]])
    assert MeanSquaredError()(y_true, y_pred).item() == pytest.approx(4 / 3)
    assert MeanAbsoluteError()(y_true, y_pred).item() == pytest.approx(2 / 3)
    assert BinaryCrossentropy()(torch.tensor([1.0, 0.0]), torch.tensor([[0.8], [0.4]])).ndim == 0


def test_huber():
    loss = Huber(delta=1.0)(torch.tensor([0.0, 0.0]), torch.tensor([0.5, 2.0]))
    assert loss.item() == pytest.approx((0.125 + 1.5) / 2)
    assert Huber().name == "huber_loss"


def test_sample_weight_and_reductions_follow_keras():
    y_true = torch.tensor([[0.0], [0.0]])
    y_pred = torch.tensor([[1.0], [2.0]])
    weight = torch.tensor([1.0, 0.0])
    assert MeanSquaredError()(y_true, y_pred, sample_weight=weight).item() == pytest.approx(0.5)
    assert MeanSquaredError(reduction="sum")(y_true, y_pred, sample_weight=weight).item() == pytest.approx(
        1.0
    )
    per_sample = MeanSquaredError(reduction="none")(y_true, y_pred, sample_weight=weight)
    assert per_sample.tolist() == [1.0, 0.0]
    assert MeanSquaredError()(y_true, y_pred, sample_weight=2.0).item() == pytest.approx(5.0)


def test_get_resolves_names_case_and_aliases():
    assert isinstance(get("sparse_categorical_crossentropy"), SparseCategoricalCrossentropy)
    assert isinstance(get("SparseCategoricalCrossentropy"), SparseCategoricalCrossentropy)
    assert isinstance(get("mse"), MeanSquaredError)
    assert isinstance(get("MAE"), MeanAbsoluteError)
    assert isinstance(get("binary_crossentropy"), BinaryCrossentropy)
    assert isinstance(get("categorical_crossentropy"), CategoricalCrossentropy)
    assert isinstance(get("huber"), Huber)
    loss = SparseCategoricalCrossentropy(from_logits=True)
    assert get(loss) is loss


def test_get_wraps_torch_loss_modules_called_prediction_first():
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.1, 0.2, 3.0]])
    labels = torch.tensor([2, 0])
    loss = get(nn.CrossEntropyLoss())
    assert isinstance(loss, Loss)
    assert torch.allclose(loss(labels, logits), F.cross_entropy(logits, labels))
    weighted = loss(labels, logits, sample_weight=torch.tensor([0.0, 2.0]))
    assert torch.allclose(weighted, F.cross_entropy(logits[1:], labels[1:]))


def test_get_wraps_callables_and_averages_their_values():
    loss = get(lambda y_true, y_pred: (y_true - y_pred).abs())
    assert loss(torch.tensor([0.0, 0.0]), torch.tensor([1.0, 3.0])).item() == pytest.approx(2.0)


def test_get_rejects_unknown_names_echoing_them():
    with pytest.raises(ValueError, match=r"received loss='nope'") as info:
        get("nope")
    assert "sparse_categorical_crossentropy" in str(info.value)
    with pytest.raises(TypeError, match="received loss=42"):
        get(42)


def test_constructor_validation_echoes_values():
    with pytest.raises(ValueError, match=r"received reduction='avg'"):
        MeanSquaredError(reduction="avg")
    with pytest.raises(ValueError, match=r"received delta=-1"):
        Huber(delta=-1)
    with pytest.raises(ValueError, match=r"received label_smoothing=2"):
        CategoricalCrossentropy(label_smoothing=2)
    with pytest.raises(TypeError, match=r"received from_logits='yes'"):
        SparseCategoricalCrossentropy(from_logits="yes")


def test_serialize_round_trip_through_json():
    loss = CategoricalCrossentropy(from_logits=True, label_smoothing=0.1)
    config = json.loads(json.dumps(serialize(loss)))
    restored = deserialize(config)
    assert isinstance(restored, CategoricalCrossentropy)
    assert restored.get_config() == loss.get_config()
    assert isinstance(get(config), CategoricalCrossentropy)
    assert serialize("mse") == {"class_name": "MeanSquaredError", "config": MeanSquaredError().get_config()}


def test_serialize_gives_none_for_modules_and_callables():
    assert serialize(nn.MSELoss()) is None
    assert serialize(lambda y_true, y_pred: y_pred) is None


def test_deserialize_rejects_unknown_class():
    with pytest.raises(ValueError, match=r"received class_name='Foo'"):
        deserialize({"class_name": "Foo", "config": {}})


# ---- issue 25, point 12: the string losses help with logits --------------------------------------
def _fit_once(module, loss, y):
    model = mf.Model(module)
    model.compile("sgd", loss)
    model.fit(np.ones((4, 3), "f4"), y, batch_size=2, epochs=2, verbose=0)


def test_probability_losses_warn_once_on_logits():
    torch.manual_seed(0)
    labels = np.array([0, 1, 2, 0])
    with pytest.warns(UserWarning, match=r"from_logits=False.*not probabilities.*"
                                         r"SparseCategoricalCrossentropy\(from_logits=True\)") as caught:
        _fit_once(nn.Linear(3, 3), "sparse_categorical_crossentropy", labels)
    assert sum("not probabilities" in str(w.message) for w in caught) == 1  # once, not every step
    with pytest.warns(UserWarning, match=r"CategoricalCrossentropy\(from_logits=True\)"):
        _fit_once(nn.Linear(3, 3), "categorical_crossentropy", np.eye(3, dtype="f4")[labels])
    with pytest.warns(UserWarning, match=r"BinaryCrossentropy\(from_logits=True\)"):
        BinaryCrossentropy()(torch.tensor([1.0, 0.0]), torch.tensor([2.5, -1.0]))
    # Probabilities (a softmax), and from_logits=True on logits, stay silent.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fit_once(nn.Sequential(nn.Linear(3, 3), nn.Softmax(dim=-1)), "sparse_categorical_crossentropy", labels)
        _fit_once(nn.Linear(3, 3), mf.losses.SparseCategoricalCrossentropy(from_logits=True), labels)


def test_categorical_crossentropy_with_integer_labels_names_the_sparse_loss():
    with pytest.raises(ValueError, match=r"Invalid targets for `categorical_crossentropy`: expected one-hot targets "
                                         r"of the predictions' shape \(2, 3\), received targets of shape \(2,\)\. "
                                         r"For integer class labels use loss='sparse_categorical_crossentropy'"):
        CategoricalCrossentropy()(torch.tensor([0, 2]), torch.full((2, 3), 1 / 3))
    with pytest.raises(ValueError, match=r"received targets of shape \(2, 1\).*sparse_categorical_crossentropy"):
        _fit_once(nn.Sequential(nn.Linear(3, 3), nn.Softmax(dim=-1)), "categorical_crossentropy",
                  np.array([[0], [1], [2], [0]], "f4"))


@pytest.mark.parametrize("module, targets", [
    (nn.MSELoss(reduction="sum"), torch.randn(4, 3)),
    (nn.MSELoss(), torch.randn(4, 3)),
    (nn.CrossEntropyLoss(ignore_index=-100), torch.tensor([0, 2, -100, 1])),
    (nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0])), torch.tensor([0, 2, 1, 1])),
    (nn.CrossEntropyLoss(reduction="sum", ignore_index=1), torch.tensor([0, 2, 1, 1])),
    (nn.NLLLoss(ignore_index=0), torch.tensor([0, 2, 0, 1])),
])
def test_a_torch_loss_module_is_unchanged_by_unit_sample_weights(module, targets):
    # a weight of one on every sample (what class_weight gives a class it leaves alone) changes nothing:
    # a module's sum stayed a sum divided by the batch, and a mean ignored its ignore_index / class weights
    loss = mf.losses.get(module)
    scores = torch.randn(4, 3).log_softmax(-1)
    assert float(loss(targets, scores, sample_weight=torch.ones(4))) == pytest.approx(float(loss(targets, scores)))


def test_a_torch_cross_entropy_weights_samples_over_the_targets_it_counts():
    loss = mf.losses.get(nn.CrossEntropyLoss(ignore_index=-100))
    scores, targets, weights = torch.randn(4, 3), torch.tensor([0, 2, -100, 1]), torch.tensor([2.0, 0.0, 5.0, 1.0])
    each = F.cross_entropy(scores, targets, reduction="none")
    assert float(loss(targets, scores, sample_weight=weights)) == pytest.approx(float((weights * each).sum() / 3))
