"""`EarlyStopping`: stop `fit` when a monitored metric stops improving."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from meshfit.callbacks._callback import Callback, _is_chief, _to_float
from meshfit.callbacks._monitor import best_from_state, best_to_state, check_mode, is_improvement, monitor_op


class EarlyStopping(Callback):
    """Stops training when ``monitor`` has not improved for ``patience`` epochs (Keras semantics).

    An epoch improves when its value beats the best so far by more than ``min_delta``. After
    ``patience`` epochs without improvement it sets ``model.stop_training = True``; `fit`
    finishes the epoch and stops. With ``restore_best_weights`` the weights of the best epoch
    are put back when training ends (as in Keras 3).

    Args:
        monitor: The log key to watch, e.g. ``"val_loss"``.
        min_delta: Smallest change that counts as an improvement (its sign is ignored).
        patience: Epochs without improvement before stopping.
        verbose: 1 prints when it stops and when it restores weights (on the chief only).
        mode: ``"min"``, ``"max"``, or ``"auto"`` (the loss and errors down; accuracy, AUC,
            precision, recall and F1-like metrics up; another name is an error when ``fit``
            starts). An unknown mode warns and falls back to ``"auto"``, as in Keras.
        baseline: A value to beat: training stops once ``patience`` epochs pass without beating it, except
            in an epoch that improves on the best so far (Keras 3).
        restore_best_weights: Restore the weights of the best epoch at the end of training
            (``model.get_weights()`` / ``model.set_weights()``).
        start_from_epoch: Epochs to wait before watching (a warm-up).

    Attributes:
        stopped_epoch: The 0-based epoch after which training stopped, 0 if it did not stop.
        best_epoch: The 0-based epoch with the best value.

    Raises:
        ValueError: If ``patience`` / ``start_from_epoch`` is negative; at ``fit``'s start, if
            ``mode="auto"`` cannot tell the direction of ``monitor``.

    Example:
        >>> early_stopping = EarlyStopping(monitor="loss", patience=2)
        >>> early_stopping.patience
        2
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0,
        patience: int = 0,
        verbose: int = 0,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best_weights: bool = False,
        start_from_epoch: int = 0,
    ) -> None:
        super().__init__()
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"Invalid `patience`: expected an int >= 0, received patience={patience!r}.")
        if (
            isinstance(start_from_epoch, bool)
            or not isinstance(start_from_epoch, int)
            or start_from_epoch < 0
        ):
            raise ValueError(
                "Invalid `start_from_epoch`: expected an int >= 0, "
                f"received start_from_epoch={start_from_epoch!r}."
            )
        self.monitor = monitor
        self.patience = patience
        self.verbose = verbose
        self.baseline = baseline
        self.restore_best_weights = restore_best_weights
        self.start_from_epoch = start_from_epoch
        self.mode = check_mode(mode, "EarlyStopping")
        self.monitor_op = monitor_op(monitor, self.mode, "EarlyStopping")  # None: told when fit starts
        self.min_delta = abs(min_delta)
        self._restored = False
        self._reset()

    def _reset(self) -> None:
        self.wait = 0
        self.stopped_epoch = 0
        self.best: float | None = None  # Keras 3: the first value seen is the best so far
        self.best_weights: list[Any] | None = None
        self.best_epoch = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Starts watching afresh, unless state was just restored for a resumed run."""
        self._require_monitor_op()
        if not self._restored:
            self._reset()
        self._restored = False

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Compares the epoch's value with the best and stops training when patience runs out."""
        self._require_monitor_op()
        current = self._monitor_value(logs)
        if current is None or epoch < self.start_from_epoch:
            return
        if self.restore_best_weights and self.best_weights is None:
            # So that some weights are restored even if no epoch ever improves.
            self.best_weights = self._require_model().get_weights()
            self.best_epoch = epoch
        self.wait += 1
        if self._is_improvement(current, self.best):
            self.best = current
            self.best_epoch = epoch
            if self.restore_best_weights:
                self.best_weights = self._require_model().get_weights()
            # The wait restarts where the epoch beats both the baseline and the previous best; an
            # improvement short of the baseline does not stop training either (Keras 3's rule: steady
            # progress toward the baseline goes on; Keras 2 stopped it once patience ran out).
            if self.baseline is None or self._is_improvement(current, self.baseline):
                self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self._require_model().stop_training = True

    def on_train_end(self, logs: dict | None = None) -> None:
        """Reports the stop and restores the best weights if asked to."""
        self._restored = False  # a state restored after on_train_begin is for this fit only
        if self.stopped_epoch > 0:
            self._say(f"Epoch {self.stopped_epoch + 1}: early stopping")
        if self.restore_best_weights and self.best_weights is not None:
            self._say(f"Restoring model weights from the end of the best epoch: {self.best_epoch + 1}.")
            self._require_model().set_weights(self.best_weights)

    def _require_monitor_op(self) -> None:
        if self.monitor_op is None:
            self.monitor_op = monitor_op(self.monitor, self.mode, "EarlyStopping", self.model, required=True)

    def _is_improvement(self, value: float, reference: float | None) -> bool:
        return is_improvement(self.monitor_op, value, reference, self.min_delta)

    def _monitor_value(self, logs: dict | None) -> float | None:
        logs = logs or {}
        value = logs.get(self.monitor)
        if value is None:
            warnings.warn(
                f"Early stopping conditioned on metric `{self.monitor}` which is not available. "
                f"Available metrics are: {','.join(logs)}",
                stacklevel=3,
            )
            return None
        return _to_float(value)

    def _say(self, message: str) -> None:
        if self.verbose > 0 and _is_chief(self.model):
            print(message, flush=True)

    def state_dict(self) -> dict[str, Any]:
        """The wait count, best value and epoch, stopped epoch and best weights."""
        return {
            "wait": self.wait,
            "best": best_to_state(self.best),
            "best_epoch": self.best_epoch,
            "stopped_epoch": self.stopped_epoch,
            # An empty list stands for "none yet", so every value is a number or an array.
            "best_weights": [np.array(w) for w in self.best_weights or []],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores `state_dict`'s values; the next `on_train_begin` keeps them."""
        self.wait = int(state["wait"])
        self.best = best_from_state(state["best"])
        self.best_epoch = int(state["best_epoch"])
        self.stopped_epoch = int(state["stopped_epoch"])
        self.best_weights = [np.array(w) for w in state["best_weights"]] or None
        self._restored = True
