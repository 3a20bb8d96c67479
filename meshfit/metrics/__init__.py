"""Metrics with additive state, summed across replicas; `get` resolves Keras-style identifiers."""

from meshfit.metrics._metrics import (
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
)
from meshfit.metrics._resolve import get
from meshfit.metrics._torchmetrics import TorchMetricsMetric

__all__ = [
    "Accuracy",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "Mean",
    "MeanAbsoluteError",
    "MeanMetricWrapper",
    "MeanSquaredError",
    "Metric",
    "SparseCategoricalAccuracy",
    "SparseTopKCategoricalAccuracy",
    "Sum",
    "TorchMetricsMetric",
    "get",
]
