"""Metrics with additive state, summed across replicas; `get` resolves Keras-style identifiers."""

from meshfit._export import publish as _publish
from meshfit.metrics._accuracy import (
    Accuracy,
    BinaryAccuracy,
    CategoricalAccuracy,
    SparseCategoricalAccuracy,
    SparseTopKCategoricalAccuracy,
)
from meshfit.metrics._mean import Mean, MeanMetricWrapper
from meshfit.metrics._metrics import Metric, Sum
from meshfit.metrics._regression import MeanAbsoluteError, MeanSquaredError

# Seams for meshfit's other packages (not public API: not in __all__).
from meshfit.metrics._resolve import CLASSES as CLASSES
from meshfit.metrics._resolve import builtin_config as builtin_config
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

_publish(__name__)
