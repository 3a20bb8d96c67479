"""`ReplicaState`: what differs between a loop's replicas (random streams, metric accumulators, a
gradient accumulation window's sums), saved once per rank."""

from __future__ import annotations

from typing import Any

from meshfit._engine._state import RandomState
from meshfit._protocols import Trainable
from meshfit.optimizers import AccumulatedGradients


class ReplicaState:
    """The state that differs between replicas: RNG streams, the metrics' running accumulators and,
    inside a gradient accumulation window, the gradients summed so far.

    Saved once per rank (``meshfit.train.PerRank``): each replica's metric sums cover its own
    share of the batches, its random streams are its own, and so are its gradient sums (its own
    batches', not yet all-reduced; `AccumulatedGradients`).
    """

    def __init__(self, trainable: Trainable) -> None:
        self._trainable = trainable
        self._random = RandomState(trainable.strategy.device)

    def state_dict(self) -> dict[str, Any]:
        metrics = {f"{i}:{m.name}": m.state_dict() for i, m in enumerate(self._trainable.metrics)}
        state = {"rng": self._random.state_dict(), "metrics": metrics}
        gradients = self._gradients()
        if gradients is not None:
            state["gradients"] = gradients.state_dict()
        return state

    def _gradients(self) -> AccumulatedGradients | None:
        optimizer = getattr(self._trainable, "optimizer", None)
        if getattr(optimizer, "gradient_accumulation_steps", None) and getattr(optimizer, "built", False):
            return AccumulatedGradients(optimizer, self._trainable.strategy.num_processes)
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["metrics"]
        for i, metric in enumerate(self._trainable.metrics):
            key = f"{i}:{metric.name}"
            if key not in saved:
                raise ValueError(f"The backup has no state for metric {key!r} (it has {sorted(saved)}): "
                                 "compile the model with the same metrics as the run that made it.")
            metric.load_state_dict(saved[key])
        self._random.load_state_dict(state["rng"])
        gradients = self._gradients()
        if gradients is not None and "gradients" in state:
            gradients.load_state_dict(state["gradients"])
