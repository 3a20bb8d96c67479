"""Resolving metric identifiers: names, `Metric` objects, torchmetrics metrics and plain functions."""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from meshfit import losses
from meshfit.losses import TorchModuleLoss as _TorchModuleLoss
from meshfit.losses import get as get_loss
from meshfit.losses import snake_case
from meshfit.metrics._accuracy import (
    Accuracy,
    BinaryAccuracy,
    CategoricalAccuracy,
    SparseCategoricalAccuracy,
    SparseTopKCategoricalAccuracy,
    _AutoAccuracy,
    _CrossEntropyAccuracy,
)
from meshfit.metrics._mean import MeanMetricWrapper
from meshfit.metrics._metrics import Metric
from meshfit.metrics._regression import MeanAbsoluteError, MeanSquaredError
from meshfit.metrics._torchmetrics import TorchMetricsMetric

#: The built-in metric classes by class name (what a saved model's compile config can name).
CLASSES: dict[str, type[Metric]] = {
    cls.__name__: cls
    for cls in (
        SparseCategoricalAccuracy,
        CategoricalAccuracy,
        BinaryAccuracy,
        Accuracy,
        SparseTopKCategoricalAccuracy,
        MeanSquaredError,
        MeanAbsoluteError,
    )
}
_ALIASES: dict[str, type[Metric]] = {
    "mse": MeanSquaredError,
    "mae": MeanAbsoluteError,
    **{snake_case(name): cls for name, cls in CLASSES.items()},
    **CLASSES,
}
_LOOKUP = {key.replace("_", "").lower(): cls for key, cls in _ALIASES.items()}


def builtin_config(metric: Metric) -> dict[str, Any]:
    """A built-in metric's constructor arguments (`CLASSES`): its name, and a wrapper's keywords (``k``,
    ``threshold``), so that a saved model's compile config rebuilds it."""
    keywords = metric._fn_kwargs if isinstance(metric, MeanMetricWrapper) else {}
    return {"name": metric.name, **keywords}


def _accuracy_for(name: str, loss: Any) -> Metric:
    """Keras's `"accuracy"`: the accuracy that matches the loss, else chosen from shapes."""
    if isinstance(loss, str | dict):
        try:
            loss = get_loss(loss)
        except (ValueError, TypeError):
            loss = None
    if isinstance(loss, _TorchModuleLoss):
        loss = loss.module
    if isinstance(loss, nn.CrossEntropyLoss):  # class indices or class probabilities
        return _CrossEntropyAccuracy(name)
    if isinstance(loss, losses.SparseCategoricalCrossentropy | nn.NLLLoss):
        return SparseCategoricalAccuracy(name)
    if isinstance(loss, losses.CategoricalCrossentropy):
        return CategoricalAccuracy(name)
    if isinstance(loss, losses.BinaryCrossentropy | nn.BCELoss | nn.BCEWithLogitsLoss):
        logits = isinstance(loss, nn.BCEWithLogitsLoss) or (isinstance(loss, losses.BinaryCrossentropy) and loss.from_logits)
        return BinaryAccuracy(name, threshold=0.0 if logits else 0.5)
    return _AutoAccuracy(name)


def get(identifier: Any, loss: Any = None) -> Metric:
    """Resolve a metric identifier to a `Metric`.

    `"accuracy"` / `"acc"` follow the loss: sparse categorical accuracy for sparse categorical
    cross-entropy (also `nn.NLLLoss`, and `nn.CrossEntropyLoss` with class-index targets; categorical
    accuracy where its targets are class probabilities), categorical accuracy for categorical
    cross-entropy, binary accuracy for binary cross-entropy (threshold 0 when it takes logits). With
    any other loss each batch picks by shape as Keras 3 does: binary when `y_pred`'s last dim is 1,
    sparse when `y_true` has fewer dims (or a last dim of 1), else categorical. A string's metric is
    named by the string as given.

    Args:
        identifier: A name (`"accuracy"`, `"acc"`, `"mse"`, `"mae"`, `"sparse_categorical_accuracy"`,
            `"categorical_accuracy"`, `"binary_accuracy"`, `"sparse_top_k_categorical_accuracy"`, or a
            class name), a `Metric` (returned as is), a `torchmetrics.Metric` (wrapped in
            `TorchMetricsMetric`), or a callable `fn(y_true, y_pred)` (its mean, named after `fn`).
        loss: The compiled loss (anything `meshfit.losses.get` accepts), used for `"accuracy"`.

    Returns:
        The metric.

    Raises:
        ValueError: If a name is unknown.
        TypeError: If the identifier has an unsupported type.

    Example:
        >>> import meshfit.metrics as metrics
        >>> type(metrics.get("accuracy", loss="sparse_categorical_crossentropy")).__name__
        'SparseCategoricalAccuracy'
    """
    if isinstance(identifier, Metric):
        return identifier
    if isinstance(identifier, str):
        if identifier.lower() in ("accuracy", "acc"):
            return _accuracy_for(identifier, loss)
        cls = _LOOKUP.get(identifier.replace("_", "").lower())
        if cls is None:
            valid = sorted({"accuracy", "acc", *_ALIASES})
            raise ValueError(f"Invalid `metric`: expected one of {valid}, received metric={identifier!r}.")
        return cls(name=identifier)
    # A torchmetrics metric exists only if torchmetrics was imported: importing it here would cost
    # every `import meshfit` (torchmetrics imports matplotlib.pyplot when matplotlib is present).
    torchmetrics = sys.modules.get("torchmetrics")
    if torchmetrics is not None and isinstance(identifier, torchmetrics.Metric):
        return TorchMetricsMetric(identifier)
    if callable(identifier):
        return MeanMetricWrapper(identifier)
    raise TypeError(
        "Invalid `metric`: expected a name, a meshfit Metric, a torchmetrics Metric or a callable, "
        f"received metric={identifier!r} of type {type(identifier).__name__}."
    )
