"""Keras 3's loss and metric cases (keras-team/keras @ 3422977a5e38: losses_test.py, accuracy_metrics_test.py,
reduction_metrics_test.py, LossFunctionWrapper, Loss.__call__, in_top_k) run on meshfit's losses and metrics."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import meshfit
from meshfit import losses, metrics, mixed_precision


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


Y_TRUE = [[1, 9, 2], [-5, -2, 6]]
Y_PRED = [[4, 8, 12], [8, 1, 3]]
ONE_HOT = [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
PROBS = [[0.9, 0.05, 0.05], [0.5, 0.89, 0.6], [0.05, 0.01, 0.94]]
LOGITS = [[8.0, 1.0, 1.0], [0.0, 9.0, 1.0], [2.0, 3.0, 5.0]]


# keras/src/losses/losses_test.py
@pytest.mark.parametrize(("loss", "y_true", "y_pred", "kwargs", "expected"), [
    (losses.MeanSquaredError(), Y_TRUE, Y_PRED, {}, 49.5),
    (losses.MeanSquaredError(), Y_TRUE, Y_PRED, {"sample_weight": t([[1.2], [3.4]])}, 767.8 / 6),
    (losses.MeanSquaredError(reduction="sum"), Y_TRUE, Y_PRED, {"sample_weight": 2.3}, 227.69998),
    (losses.MeanAbsoluteError(), Y_TRUE, Y_PRED, {"sample_weight": t([[1.2], [3.4]])}, 81.4 / 6),
    (losses.BinaryCrossentropy(), [[1, 0], [1, 0]], [[1, 1], [1, 0]], {"sample_weight": t([[1.2], [3.4]])}, 4.7827),
    (losses.BinaryCrossentropy(from_logits=True), [[1, 0, 1], [0, 1, 1]],
     [[10.0, -10.0, 10.0], [10.0, 10.0, -10.0]], {"sample_weight": t([4, 3])}, 10.0),
    (losses.CategoricalCrossentropy(), ONE_HOT, PROBS, {"sample_weight": t([[1.2], [3.4], [5.6]])}, 1.0696),
    (losses.CategoricalCrossentropy(from_logits=True), ONE_HOT, LOGITS, {"sample_weight": 2.3}, 0.1317),
    (losses.SparseCategoricalCrossentropy(), [[0], [1], [2]], PROBS, {"sample_weight": 2.3}, 0.7449),
    (losses.SparseCategoricalCrossentropy(from_logits=True), [[0], [1], [2]], LOGITS,
     {"sample_weight": t([[1.2], [3.4], [5.6]])}, 0.31829),
])
def test_keras_loss_cases(loss, y_true, y_pred, kwargs, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        value = loss(t(y_true), t(y_pred), **kwargs)
    assert float(value) == pytest.approx(expected, abs=1e-3)


def test_keras_scce_ignore_class():
    loss = losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1, reduction="none")
    logits = t([[[0.854, 0.698, 0.598], [0.088, 0.86, 0.018]]])
    np.testing.assert_allclose(loss(t([[-1, 2]], torch.int64), logits).numpy(), [[0.0, 1.480129]], atol=1e-5)


# keras/src/metrics/accuracy_metrics_test.py, reduction_metrics_test.py
@pytest.mark.parametrize(("metric", "args", "kwargs", "expected"), [
    (metrics.Accuracy(), (t([[1, 2], [3, 4]]), t([[0, 2], [3, 4]])), {"sample_weight": t([[1, 0]])}, 0.5),
    (metrics.BinaryAccuracy(), (t([[1, 1], [0, 0]]), t([[0.98, 1], [0, 0.6]])), {"sample_weight": t([[1, 0]])}, 1.0),
    (metrics.BinaryAccuracy(threshold=0.9), (t([[1], [1], [0], [0]]), t([[0.98], [0.5], [0.1], [0.2]])), {}, 0.75),
    (metrics.CategoricalAccuracy(), (t([[0, 0, 1], [0, 1, 0]]), t([[0.1, 0.9, 0.8], [0.05, 0.95, 0]])),
     {"sample_weight": t([0.7, 0.3])}, 0.3),
    (metrics.SparseCategoricalAccuracy(), (t([[2], [1]]), t([[0.1, 0.6, 0.3], [0.05, 0.95, 0]])),
     {"sample_weight": t([0.7, 0.3])}, 0.3),
    (metrics.SparseTopKCategoricalAccuracy(k=1), (t([2, 1], torch.int64), t([[0.1, 0.9, 0.8], [0.05, 0.95, 0]])),
     {"sample_weight": t([0.7, 0.3])}, 0.3),
    (metrics.Mean(), (t([[1, 3], [5, 7]]),), {"sample_weight": t([[1, 0]])}, 3.0),
    (metrics.Sum(), (t([[1, 3], [5, 7]]),), {"sample_weight": t([[1, 0]])}, 6.0),
])
def test_keras_metric_cases(metric, args, kwargs, expected):
    metric.update_state(*args, **kwargs)
    assert float(metric.result()) == pytest.approx(expected, abs=1e-5)


# ---- findings ------------------------------------------------------------------------------------------

def test_function_loss_squeezes_or_expands_like_keras():
    def my_mse(y_true, y_pred):
        return ((y_true - y_pred) ** 2).mean(dim=-1)

    loss = losses.get(my_mse)
    # Keras 3: y_true -> (3, 1); per-sample errors [0, 0, 1]; mean 1/3. (broadcast to (3, 3) it read 7/3)
    assert float(loss(t([1.0, 2.0, 3.0]), t([[1.0], [2.0], [4.0]]))) == pytest.approx(1 / 3, abs=1e-6)


def test_loss_is_computed_in_float32_for_low_precision_outputs():
    y_true = t([[100.3]])
    direct = losses.MeanSquaredError()(y_true, torch.tensor([[100.0]], dtype=torch.bfloat16))
    assert float(direct) == pytest.approx(0.09, abs=1e-3)  # Keras 3: 0.0900018 (in bfloat16: 0.25)

    net = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        net.weight.fill_(100.0)
    mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = meshfit.Model(net)
        model.compile(optimizer="sgd", loss="mse")
        value = model.evaluate(torch.ones(2, 1), t([[100.3], [100.3]]), verbose=0)
    finally:
        mixed_precision.set_global_policy("float32")
    assert float(value) == pytest.approx(0.09, abs=1e-3)  # Keras 3 (loss in float32): 0.09 (in bfloat16: 0.25)


def test_mean_with_negative_weights():
    metric = metrics.Mean()
    metric.update_state(t([1, 3, 5, 7]), sample_weight=t([-1, -1, 0, 0]))
    assert float(metric.result()) == pytest.approx(2.0)  # (0.0 where only a positive count divided)


def test_sparse_top_k_counts_ties_as_hits():
    metric = metrics.SparseTopKCategoricalAccuracy(k=1)
    metric.update_state(t([1], torch.int64), t([[0.5, 0.5, 0.0]]))
    assert float(metric.result()) == pytest.approx(1.0)  # (0.0 where top-k indices were compared)




# keras/src/metrics/reduction_metrics_test.py (MeanTest, MetricWrapperTest) @ 3422977a: one value a sample
@pytest.mark.parametrize(("values", "weight", "expected"), [
    ([1, 3, 5, 7], None, 4.0),
    ([1, 3, 5, 7], [1, 1, 0, 0], 2.0),
    ([[1, 3], [5, 7]], [[1, 1], [1, 0]], 3.0),
    ([[1, 3], [5, 7]], [[1, 0]], 3.0),
])
def test_keras_mean_cases(values, weight, expected):
    metric = metrics.Mean()
    metric.update_state(t(values), sample_weight=None if weight is None else t(weight))
    assert float(metric.result()) == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize(("weight", "expected"), [
    (None, 0.5), ([1.0, 1.5, 2.0, 2.5], 0.54285), ([[1.0, 0.0, 0.5, 0.0, 1.0]], 0.45),
])
def test_keras_metric_wrapper_cases(weight, expected):
    y_true = t([[0, 1, 0, 1, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 0], [0, 0, 0, 0, 1]])
    y_pred = t([[0, 0, 1, 1, 0], [1, 1, 1, 1, 1], [0, 1, 0, 1, 0], [1, 1, 1, 1, 1]])
    metric = metrics.MeanMetricWrapper(lambda a, b: (a - b) ** 2, name="mse")
    metric.update_state(y_true, y_pred, sample_weight=None if weight is None else t(weight))
    assert float(metric.result()) == pytest.approx(expected, abs=1e-5)


def test_mean_counts_samples_across_batches_of_different_lengths():
    # token accuracy over padded batches of lengths 2 and 4: each sample weighs the same (Keras 3), not
    # each token (tf-keras counted 5 hits of 6)
    metric = metrics.SparseCategoricalAccuracy()
    metric.update_state(t([[0, 1]], torch.int64), t([[[1.0, 0.0], [1.0, 0.0]]]))  # the sample's mean: 0.5
    metric.update_state(t([[0, 0, 0, 0]], torch.int64), t([[[1.0, 0.0]] * 4]))  # 1.0
    assert float(metric.result()) == pytest.approx(0.75)


def test_mean_scalar_sample_weight_weighs_the_batch_once():
    metric = metrics.Mean()
    metric.update_state(t([1.0, 3.0]), sample_weight=0.5)  # one sample of weight 0.5: its mean, 2
    metric.update_state(t([10.0]), sample_weight=1)
    assert float(metric.result()) == pytest.approx(11 / 1.5)


def test_accuracy_with_torch_cross_entropy_follows_its_targets():
    # torch's cross-entropy takes class indices or class probabilities; Keras 3 picks the accuracy by shape
    scores = t([[2.0, 0, 0], [0, 2.0, 0], [0, 0, 2.0], [2.0, 0, 0]])
    one_hot = metrics.get("accuracy", loss=nn.CrossEntropyLoss())
    one_hot.update_state(t([[1, 0, 0], [0, 1, 0], [0, 0, 1], [0, 1, 0]]), scores)
    assert float(one_hot.result()) == pytest.approx(0.75)
    indices = metrics.get("accuracy", loss=nn.CrossEntropyLoss())
    indices.update_state(t([0, 1, 2, 1], torch.int64), scores)
    assert float(indices.result()) == pytest.approx(0.75)
    assert one_hot.name == indices.name == "accuracy"


def test_losses_take_numpy_outputs_like_keras():
    # Keras's Loss.__call__ converts both arguments; a numpy y_pred failed inside torch's `to()` before
    assert float(losses.MeanSquaredError()(np.array(Y_TRUE), np.array(Y_PRED, dtype="float64"))) == pytest.approx(49.5)
    assert float(losses.SparseCategoricalCrossentropy(from_logits=True)(np.array([0, 1]), [[2.0, 0.0], [0.0, 2.0]])) \
        == pytest.approx(0.126928, abs=1e-6)
    assert float(losses.get(nn.MSELoss())(np.array([1.0]), np.array([3.0]))) == pytest.approx(4.0)
