"""Metrics: hand-computed values, replica-additive state, torchmetrics adapter, resolution."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshfit import losses
from meshfit.losses import BinaryCrossentropy, CategoricalCrossentropy, SparseCategoricalCrossentropy
from meshfit.metrics import (
    Accuracy,
    BinaryAccuracy,
    CategoricalAccuracy,
    Mean,
    MeanAbsoluteError,
    MeanMetricWrapper,
    MeanSquaredError,
    Metric,
    SparseCategoricalAccuracy,
    SparseTopKCategoricalAccuracy,
    Sum,
    TorchMetricsMetric,
    get,
)

LABELS = torch.tensor([0, 1, 2, 1])
SCORES = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.5, 0.3, 0.2], [0.2, 0.3, 0.5]])


def _replica_sum(metrics: list[Metric]) -> tuple[torch.Tensor, ...]:
    """What the loop's all-reduce does: element-wise sum of every replica's state tensors."""
    return tuple(torch.stack(group).sum(0) for group in zip(*(m.state_tensors() for m in metrics), strict=True))


def test_sparse_categorical_accuracy_with_and_without_weights():
    m = SparseCategoricalAccuracy()
    m.update_state(LABELS, SCORES)
    assert m.result().item() == pytest.approx(0.5)
    assert m.name == "sparse_categorical_accuracy"
    weighted = SparseCategoricalAccuracy()
    weighted.update_state(LABELS, SCORES, sample_weight=torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert weighted.result().item() == pytest.approx(1.0)
    column = SparseCategoricalAccuracy()
    column.update_state(LABELS[:, None], SCORES)
    assert column.result().item() == pytest.approx(0.5)


def test_other_accuracies_by_hand():
    cat = CategoricalAccuracy()
    cat.update_state(torch.nn.functional.one_hot(LABELS, 3), SCORES)
    assert cat.result().item() == pytest.approx(0.5)
    binary = BinaryAccuracy(threshold=0.5)
    binary.update_state(torch.tensor([[1.0], [0.0], [1.0]]), torch.tensor([[0.9], [0.6], [0.4]]))
    assert binary.result().item() == pytest.approx(1 / 3)
    exact = Accuracy()
    exact.update_state(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 0, 4]))
    assert exact.result().item() == pytest.approx(0.75)
    top2 = SparseTopKCategoricalAccuracy(k=2)
    top2.update_state(LABELS, SCORES)
    assert top2.result().item() == pytest.approx(0.75)


def test_regression_metrics_by_hand():
    mse, mae = MeanSquaredError(), MeanAbsoluteError()
    for m in (mse, mae):
        m.update_state(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([[1.0], [2.0], [5.0]]))
    assert mse.result().item() == pytest.approx(4 / 3)
    assert mae.result().item() == pytest.approx(2 / 3)


def test_mean_tracks_a_loss_weighted_by_batch_size_and_sum_adds():
    loss = Mean("loss")
    loss.update_state(torch.tensor(2.0), sample_weight=3)
    loss.update_state(torch.tensor(4.0), sample_weight=1)
    assert loss.name == "loss"
    assert loss.result().item() == pytest.approx(2.5)
    assert Mean().result().item() == 0.0
    total = Sum()
    total.update_state(torch.tensor([1.0, 2.0]))
    total.update_state(3.0, sample_weight=2)
    assert total.result().item() == pytest.approx(9.0)


def test_the_loss_trackers_sum_is_the_float64_sum_of_each_loss_times_its_batch_size():
    # A scalar loss weighted by a whole batch size is added in one scaled add: bit for bit the sum of
    # the float64 products, in the order given, for float32 and the narrower floats.
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tracker, expected = Mean("loss"), torch.zeros((), dtype=torch.float64)
        for _ in range(2000):
            value = (torch.rand((), generator=generator) * 10).to(dtype)
            size = int(torch.randint(1, 5000, (1,), generator=generator))
            tracker.update_state(value, sample_weight=size)
            expected += value.to(torch.float64) * float(size)
        total, count = (state.item() for state in tracker.state_dict().values())
        assert total == expected.item()
        assert total / count == tracker.result().item()


def test_sparse_accuracy_keeps_hits_until_read_and_counts_them_as_each_batch_would():
    # The usual batch's hits wait to be summed with the next ones (two kernels a step): every read
    # (result, state_dict, reset), a weighted update in between, and the bound on kept batches give the
    # states a step-by-step float64 count gives, bit for bit.
    generator = torch.Generator().manual_seed(0)
    kept, reference = SparseCategoricalAccuracy(), Mean()
    for step in range(200):
        rows = 1 + step % 37
        y_true = torch.randint(0, 5, (rows,), generator=generator)
        y_pred = torch.randn(rows, 5, generator=generator)
        weight = torch.rand(rows, generator=generator) if step % 50 == 7 else None
        kept.update_state(y_true, y_pred, sample_weight=weight)
        reference.update_state((y_pred.argmax(-1) == y_true).to(torch.float64), sample_weight=weight)
        assert len(kept._pending_hits) < 64  # at most 63 batches wait
        if step % 45 == 44:
            assert kept.result().item() == reference.result().item()
        if step == 120:
            kept.reset_state()
            reference.reset_state()
    for key, state in reference.state_dict().items():
        assert torch.equal(kept.state_dict()[key], state), key
    # Once the total holds a fraction (a float64 weight, a restored fraction), each batch's hits are added
    # at once, in order: (t + h1) + h2 + ..., as the per-batch count rounds.
    t = 0.2237140727487692
    for start in ("weighted", "restored"):
        metric = SparseCategoricalAccuracy()
        if start == "weighted":
            metric.update_state(torch.tensor([0]), torch.tensor([[1.0, 0.0]]),
                                sample_weight=torch.tensor([t], dtype=torch.float64))
        else:
            metric.load_state_dict({"total": torch.tensor(t, dtype=torch.float64),
                                    "count": torch.tensor(1.0, dtype=torch.float64)})
        expected = t
        for rows in (23, 18, 36, 34):  # all hits, unweighted: the usual batch
            metric.update_state(torch.zeros(rows, dtype=torch.int64), torch.tensor([[1.0, 0.0]]).repeat(rows, 1))
            expected += float(rows)
        assert metric.state_dict()["total"].item() == expected, start
    # The same for the count: after a fractional weight, each batch's whole count is added at once, in order.
    for start in ("weighted", "restored"):
        mean = Mean()
        if start == "weighted":
            mean.update_state(torch.tensor([1.0], dtype=torch.float64), sample_weight=torch.tensor([t], dtype=torch.float64))
        else:
            mean.load_state_dict({"total": torch.tensor(t, dtype=torch.float64), "count": torch.tensor(t, dtype=torch.float64)})
        expected = t
        for rows in (23, 18, 36, 34):
            mean.update_state(torch.ones(rows))
            expected += float(rows)
        assert mean.state_dict()["count"].item() == expected, start


def test_mean_metric_wrapper_is_named_after_function():
    def doubled_error(y_true, y_pred):
        return 2 * (y_true - y_pred).abs()

    m = MeanMetricWrapper(doubled_error)
    m.update_state(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]))
    assert m.name == "doubled_error"
    assert m.result().item() == pytest.approx(1.0)


CASES = [
    (SparseCategoricalAccuracy, LABELS.repeat(2), SCORES.repeat(2, 1)),
    (SparseTopKCategoricalAccuracy, LABELS.repeat(2), SCORES.repeat(2, 1)),
    (CategoricalAccuracy, torch.nn.functional.one_hot(LABELS, 3).repeat(2, 1), SCORES.repeat(2, 1)),
    (BinaryAccuracy, torch.tensor([1.0, 0, 1, 1, 0, 0, 1, 0]), torch.linspace(0, 1, 8)),
    (MeanSquaredError, torch.arange(8.0), torch.arange(8.0) ** 1.5),
    (MeanAbsoluteError, torch.arange(8.0), torch.arange(8.0) ** 1.5),
]


@pytest.mark.parametrize(("cls", "y_true", "y_pred"), CASES)
@pytest.mark.parametrize("weighted", [False, True])
def test_replica_states_sum_to_the_single_replica_result(cls, y_true, y_pred, weighted):
    weight = torch.linspace(0.5, 2.0, 8) if weighted else None
    whole = cls()
    whole.update_state(y_true, y_pred, sample_weight=weight)
    replicas = [cls(), cls()]
    for replica, part in zip(replicas, (slice(0, 3), slice(3, 8)), strict=True):  # uneven halves
        replica.update_state(y_true[part], y_pred[part], None if weight is None else weight[part])
    combined = replicas[0].result_from(_replica_sum(replicas))
    assert torch.allclose(combined, whole.result(), rtol=1e-12, atol=0)
    assert 0 < replicas[0].result_from(whole.state_tensors()).item() == pytest.approx(whole.result().item())


def test_states_are_float64_cpu_copies():
    m = SparseCategoricalAccuracy()
    m.update_state(LABELS, SCORES)
    states = m.state_tensors()
    assert all(t.dtype == torch.float64 and t.device.type == "cpu" for t in states)
    for t in states:
        t.mul_(10)  # an in-place all-reduce must not touch the metric
    assert m.result().item() == pytest.approx(0.5)


def test_reset_and_state_dict_round_trip():
    m = SparseCategoricalAccuracy()
    m.update_state(LABELS, SCORES)
    restored = SparseCategoricalAccuracy()
    restored.load_state_dict(m.state_dict())
    assert restored.result().item() == pytest.approx(0.5)
    m.reset_state()
    assert m.result().item() == 0.0
    with pytest.raises(ValueError, match=r"received keys \['bogus'\]"):
        restored.load_state_dict({"bogus": torch.tensor(1.0)})


@pytest.fixture(name="torchmetrics", scope="module")
def torchmetrics_fixture():
    """torchmetrics, imported by the tests that use it: imported by this module, it cost 2-3 s of CPU in
    every pytest worker's collection (with scipy.signal); those tests run in one worker (their group)."""
    import torchmetrics
    import torchmetrics.classification

    return torchmetrics


@pytest.mark.xdist_group("torchmetrics")
def test_torchmetrics_adapter_matches_and_sums_across_replicas(torchmetrics):
    MulticlassAccuracy = torchmetrics.classification.MulticlassAccuracy  # noqa: N806
    whole = TorchMetricsMetric(MulticlassAccuracy(num_classes=3, average="micro"))
    whole.update_state(LABELS, SCORES)
    assert whole.result().item() == pytest.approx(0.5)
    assert whole.metric.sync_on_compute is False
    replicas = [get(MulticlassAccuracy(num_classes=3, average="micro")) for _ in range(2)]
    replicas[0].update_state(LABELS[:1], SCORES[:1])
    replicas[1].update_state(LABELS[1:], SCORES[1:])
    assert replicas[0].result().item() == pytest.approx(1.0)
    assert replicas[0].result_from(_replica_sum(replicas)).item() == pytest.approx(0.5)
    assert replicas[0].result().item() == pytest.approx(1.0)  # result_from left its own states alone


@pytest.mark.xdist_group("torchmetrics")
def test_torchmetrics_regression_adapter_state_dict_and_reset(torchmetrics):
    m = get(torchmetrics.MeanSquaredError())
    assert isinstance(m, TorchMetricsMetric) and m.name == "mean_squared_error"
    m.update_state(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 5.0]))
    assert m.result().item() == pytest.approx(4 / 3)
    restored = TorchMetricsMetric(torchmetrics.MeanSquaredError(), name="mse")
    restored.load_state_dict(m.state_dict())
    assert restored.result().item() == pytest.approx(4 / 3)
    m.reset_state()
    assert all(t.sum().item() == 0 for t in m.state_tensors())


@pytest.mark.xdist_group("torchmetrics")
def test_torchmetrics_adapter_rejects_non_summable_metrics_and_weights(torchmetrics):
    with pytest.raises(TypeError, match="summed across replicas"):
        TorchMetricsMetric(torchmetrics.MaxMetric())
    with pytest.raises(TypeError, match="summed across replicas"):
        TorchMetricsMetric(torchmetrics.classification.BinaryAUROC())
    m = TorchMetricsMetric(torchmetrics.MeanSquaredError())
    with pytest.raises(TypeError, match="sample_weight"):
        m.update_state(torch.zeros(2), torch.zeros(2), sample_weight=torch.ones(2))


@pytest.mark.parametrize(
    ("loss", "cls"),
    [
        ("sparse_categorical_crossentropy", SparseCategoricalAccuracy),
        (SparseCategoricalCrossentropy(from_logits=True), SparseCategoricalAccuracy),
        (nn.CrossEntropyLoss(), "torch cross-entropy"),  # sparse for indices, categorical for probabilities
        (losses.get(nn.NLLLoss()), SparseCategoricalAccuracy),
        (losses.serialize("sparse_categorical_crossentropy"), SparseCategoricalAccuracy),
        ("categorical_crossentropy", CategoricalAccuracy),
        (CategoricalCrossentropy(), CategoricalAccuracy),
        ("binary_crossentropy", BinaryAccuracy),
        (nn.BCEWithLogitsLoss(), BinaryAccuracy),
    ],
)
def test_accuracy_follows_the_loss(loss, cls):
    from meshfit.metrics._accuracy import _CrossEntropyAccuracy

    cls = _CrossEntropyAccuracy if cls == "torch cross-entropy" else cls
    m = get("accuracy", loss=loss)
    assert type(m) is cls
    assert m.name == "accuracy"
    assert get("acc", loss=loss).name == "acc"


def test_binary_accuracy_on_logits_thresholds_at_zero():
    m = get("accuracy", loss=BinaryCrossentropy(from_logits=True))
    m.update_state(torch.tensor([1.0, 0.0]), torch.tensor([0.3, -0.2]))
    assert m.result().item() == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("y_true", "y_pred"),
    [
        (LABELS, SCORES),  # sparse
        (torch.nn.functional.one_hot(LABELS, 3), SCORES),  # categorical
        (torch.tensor([[1.0], [0.0]]), torch.tensor([[0.9], [0.7]])),  # binary
    ],
)
def test_accuracy_with_unknown_loss_picks_by_shape(y_true, y_pred):
    m = get("accuracy", loss="mse")
    m.update_state(y_true, y_pred)
    assert m.result().item() == pytest.approx(0.5)


def test_get_resolves_names_instances_and_callables():
    mse = get("mse")
    assert type(mse) is MeanSquaredError and mse.name == "mse"
    assert type(get("sparse_top_k_categorical_accuracy")) is SparseTopKCategoricalAccuracy
    assert type(get("BinaryAccuracy")) is BinaryAccuracy
    assert get("mean_absolute_error").name == "mean_absolute_error"
    m = Mean("x")
    assert get(m) is m

    def hits(y_true, y_pred):
        return (y_true == y_pred).float()

    wrapped = get(hits)
    assert isinstance(wrapped, MeanMetricWrapper) and wrapped.name == "hits"


def test_get_rejects_unknown_identifiers_echoing_them():
    with pytest.raises(ValueError, match=r"received metric='precision_at_3'") as info:
        get("precision_at_3")
    assert "sparse_categorical_accuracy" in str(info.value)
    with pytest.raises(TypeError, match=r"received metric=7"):
        get(7)
    with pytest.raises(ValueError, match=r"received k=0"):
        SparseTopKCategoricalAccuracy(k=0)


def test_reset_states_is_reset_state():
    # TF 2.x tutorials call `train_accuracy.reset_states()` at each epoch's end.
    metric = SparseCategoricalAccuracy()
    metric.update_state(torch.tensor([1]), torch.tensor([[0.0, 1.0]]))
    assert float(metric.result()) == 1.0
    metric.reset_states()
    assert [float(t) for t in metric.state_tensors()] == [0.0, 0.0]
    assert float(metric.local_result()) == float(metric.result())
