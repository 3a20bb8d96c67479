"""`History`: the per-epoch record of logs that `fit` returns."""

from __future__ import annotations

import copy
from typing import Any

from meshfit.callbacks._callback import Callback, _to_float


class History(Callback):
    """Records every epoch's logs; `Model.fit` returns its `History`.

    Calling `fit` again with the same `History` extends the record (as Keras does with a
    history passed in), and a resumed `fit` restores it through `state_dict`, so after a
    restart ``history`` still covers every epoch.

    Attributes:
        history: Metric name -> list of per-epoch values (floats), e.g. ``{"loss": [0.9, 0.5]}``.
        epoch: The 0-based epoch indices recorded, one per value in each list.

    Example:
        >>> history = History()
        >>> history.on_train_begin()
        >>> history.on_epoch_end(0, {"loss": 0.75, "val_loss": 0.8})
        >>> history.history["loss"], history.epoch
        ([0.75], [0])
    """

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, list[Any]] = {}
        self.epoch: list[int] = []

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Appends the epoch's values."""
        self.epoch.append(int(epoch))
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(_to_float(value))
        if self.model is not None:
            # Keras sets it after each epoch so `model.history` is current even mid-fit.
            self.model.history = self

    def state_dict(self) -> dict[str, Any]:
        """The recorded epochs and values."""
        return {"epoch": list(self.epoch), "history": copy.deepcopy(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replaces the record with a saved one."""
        self.epoch = [int(e) for e in state["epoch"]]
        self.history = {key: list(values) for key, values in state["history"].items()}
