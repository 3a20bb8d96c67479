"""`TerminateOnNaN`: stop training as soon as the loss is NaN or infinite."""

from __future__ import annotations

import math

from meshfit.callbacks._callback import Callback, _is_chief, _to_float


class TerminateOnNaN(Callback):
    """Stops `fit` after the first step whose loss is NaN or infinite.

    The step's loss is the one reduced over all replicas, so every worker stops together.

    Example:
        >>> callback = TerminateOnNaN()
        >>> callback.on_train_batch_end(3, {"loss": 0.25})
        >>> callback.terminated_at is None
        True
    """

    def __init__(self) -> None:
        super().__init__()
        self.terminated_at: int | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Clears the stop of an earlier fit."""
        self.terminated_at = None

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Sets ``model.stop_training`` when the loss is not finite."""
        loss = _to_float((logs or {}).get("loss"))
        if isinstance(loss, float) and not math.isfinite(loss):
            self.terminated_at = batch
            if _is_chief(self.model):
                print(f"Batch {batch}: Invalid loss, terminating training", flush=True)
            if self.model is not None:
                self.model.stop_training = True
