"""`TorchMetricsMetric`: a torchmetrics metric whose sum-reduced states are summed across replicas."""

from __future__ import annotations

from typing import Any

import torch

from meshfit.losses import snake_case
from meshfit.metrics._metrics import Metric, _as_tensor


class TorchMetricsMetric(Metric):
    """Adapts a `torchmetrics.Metric` whose states all reduce by sum.

    Its own states are the accumulators (as float64 copies); torchmetrics' distributed sync is
    turned off, since meshfit sums the states across replicas itself.

    Args:
        metric: The torchmetrics metric, called as `metric.update(y_pred, y_true)`.
        name: The metric's name; defaults to the snake-case class name.

    Raises:
        TypeError: If `metric` is not a torchmetrics metric, or has a state that is a list or is
            not reduced by sum (so it cannot be summed across replicas).
    """

    def __init__(self, metric: Any, name: str | None = None) -> None:
        from torchmetrics import Metric as TMMetric
        from torchmetrics.utilities.data import dim_zero_sum

        if not isinstance(metric, TMMetric):
            raise TypeError(f"Invalid `metric`: expected a torchmetrics.Metric, received metric={metric!r}.")
        bad = [
            key
            for key, default in metric._defaults.items()
            if not isinstance(default, torch.Tensor) or metric._reductions[key] is not dim_zero_sum
        ]
        if bad:
            raise TypeError(
                f"Invalid `metric`: {type(metric).__name__} has states {bad} that are not tensors reduced by "
                "sum, so they can't be summed across replicas; use a metric with sum-reduced states "
                f"(e.g. MulticlassAccuracy(average='micro')), received metric={metric!r}."
            )
        super().__init__(name or snake_case(type(metric).__name__))
        metric.sync_on_compute = False
        metric.dist_sync_on_step = False
        metric._to_sync = False
        self.metric = metric
        self._keys = list(metric._defaults)

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """`metric.update(y_pred, y_true)`; torchmetrics metrics take no sample weights."""
        if sample_weight is not None:
            raise TypeError(
                f"Invalid `sample_weight`: the torchmetrics metric {self.name!r} can't weight samples, "
                f"received sample_weight of type {type(sample_weight).__name__}."
            )
        y_pred = _as_tensor(y_pred)
        y_true = _as_tensor(y_true).to(y_pred.device)
        if self.metric.device != y_pred.device:
            self.metric.to(y_pred.device)
        self.metric._to_sync = False
        self.metric.update(y_pred, y_true)

    def _live_states(self) -> dict[str, torch.Tensor]:
        return {key: getattr(self.metric, key) for key in self._keys}

    def _assign_states(self, states: dict[str, torch.Tensor]) -> None:
        for key, value in states.items():
            default = self.metric._defaults[key]  # a tensor state's default (list states are not kept)
            dtype = default.dtype if isinstance(default, torch.Tensor) else None
            setattr(self.metric, key, torch.as_tensor(value).to(self.metric.device, dtype))
        self.metric._computed = None
        self.metric._update_count = max(self.metric._update_count, 1)  # compute() won't warn

    def result_from(self, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Compute the torchmetrics value with `states` set temporarily (no distributed sync)."""
        if len(states) != len(self._keys):
            raise ValueError(f"Invalid `states`: expected {len(self._keys)} tensors, received {len(states)}.")
        metric = self.metric
        saved, saved_count = self._live_states(), metric._update_count
        try:
            self._assign_states(dict(zip(self._keys, states, strict=True)))
            metric._to_sync = False
            value = metric.compute()
        finally:
            self._assign_states(saved)
            metric._update_count = saved_count
        return torch.as_tensor(value).detach().to("cpu", torch.float64)

    def reset_state(self) -> None:
        """Reset the torchmetrics metric."""
        self.metric.reset()
