"""The regression metrics: the mean over samples of a loss's per-sample error."""

from __future__ import annotations

from meshfit import losses
from meshfit.metrics._mean import MeanMetricWrapper


class MeanSquaredError(MeanMetricWrapper):
    """Mean of squared errors."""

    def __init__(self, name: str = "mean_squared_error") -> None:
        super().__init__(losses.MeanSquaredError(reduction="none"), name)


class MeanAbsoluteError(MeanMetricWrapper):
    """Mean of absolute errors."""

    def __init__(self, name: str = "mean_absolute_error") -> None:
        super().__init__(losses.MeanAbsoluteError(reduction="none"), name)
