"""Metrics with additive state, summed across replicas; `get` resolves Keras-style identifiers."""

from meshfit._metrics import (
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
