"""`TrackedMetricsMixin`: a `Model`'s metrics as Keras 3 lists them, with the ones assigned as attributes.

Keras 3 tracks a metric assigned as a model's attribute (``self.my_metric = Mean()``): it is reset,
reduced across replicas and logged with the compiled ones. The assignment is where it is tracked, so
reading ``metrics`` at every step walks no attributes.
"""

from __future__ import annotations

from typing import Any

from meshfit._engine._outputs import CompileLoss
from meshfit.metrics import Mean, Metric


class TrackedMetricsMixin:
    """The metrics side of `meshfit.Model`: needs its loss tracker, compiled metrics and loss."""

    _loss_tracker: Mean
    _compiled_metrics: list[Metric]
    loss: Any

    @property
    def metrics(self) -> list[Metric]:
        """The loss tracker first, then the compiled metrics, the per-output losses (``<output>_loss``,
        with several losses) and the metrics assigned as the model's attributes (Keras 3 tracks those:
        one updated in an overridden ``compute_loss`` is reset, reduced and logged as the others)."""
        own = [self._loss_tracker, *self._compiled_metrics]
        if isinstance(self.loss, CompileLoss):
            own.extend(self.loss.metrics)
        assigned = self.__dict__.get("_assigned_metrics")
        if not assigned:
            return own
        seen = {id(m) for m in own}
        return own + [value for value in assigned.values() if id(value) not in seen]

    def __setattr__(self, name: str, value: Any) -> None:
        """Track the metrics assigned as attributes, as Keras 3 does (read at every step: no walk of the
        attributes there)."""
        assigned = self.__dict__.get("_assigned_metrics")
        if isinstance(value, Metric) and name != "_loss_tracker":  # the loss tracker leads `metrics` anyway
            if assigned is None:
                assigned = self.__dict__["_assigned_metrics"] = {}
            assigned[name] = value
        elif assigned and name in assigned:
            del assigned[name]
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        assigned = self.__dict__.get("_assigned_metrics")
        if assigned and name in assigned:
            del assigned[name]
        object.__delattr__(self, name)

    def logged_metrics(self) -> list[Metric]:
        """The metrics that appear in logs (the loss tracker only when there is a loss)."""
        metrics = self.metrics
        return metrics if self.loss is not None else metrics[1:]

    @property
    def metrics_names(self) -> list[str]:
        return [m.name for m in self.metrics]

    def reset_metrics(self) -> None:
        for metric in self.metrics:
            metric.reset_state()
