"""`ReduceLROnPlateau`: lower the learning rate when a monitored metric stops improving."""

from __future__ import annotations

import warnings
from typing import Any

from meshfit._validation import finite_float, non_negative_int
from meshfit.callbacks._callback import Callback, _is_chief, _to_float
from meshfit.callbacks._monitor import best_from_state, best_to_state, check_mode, is_improvement, monitor_op


class ReduceLROnPlateau(Callback):
    """Multiplies the learning rate by ``factor`` after ``patience`` epochs without improvement.

    Keras's rule: an epoch improves when ``monitor`` beats the best value by more than
    ``min_delta``; after a reduction, ``cooldown`` epochs pass before waiting starts again; the
    rate never goes below ``min_lr``. Every worker sees the same (all-reduced) logs, so every
    worker makes the same decision. The wait, cooldown and best value are part of the callback's
    state, and the rate itself of the optimizer's: a resumed run continues exactly.

    Args:
        monitor: The log key to watch, e.g. ``"val_loss"``.
        factor: The multiplier, in ``(0, 1)``.
        patience: Epochs without improvement before a reduction.
        verbose: 1 prints each reduction (on the chief only).
        mode: ``"min"``, ``"max"`` or ``"auto"`` (from the metric; an unknown name is an error when
            ``fit`` starts, an unknown mode warns and falls back to ``"auto"``, as in Keras).
        min_delta: The smallest change that counts as an improvement.
        cooldown: Epochs to wait after a reduction before counting again.
        min_lr: The lowest rate.

    Raises:
        ValueError: If ``factor`` is not in ``(0, 1)`` or another argument is out of range.

    Example:
        >>> reduce_lr = ReduceLROnPlateau(monitor="val_loss", factor=0.2, patience=5, min_lr=0.001)
        >>> reduce_lr.factor
        0.2
    """

    def __init__(self, monitor: str = "val_loss", factor: float = 0.1, patience: int = 10, verbose: int = 0,
                 mode: str = "auto", min_delta: float = 1e-4, cooldown: int = 0, min_lr: float = 0.0) -> None:
        super().__init__()
        factor = finite_float("factor", factor)
        if not 0.0 < factor < 1.0:
            raise ValueError(f"Invalid `factor`: expected a number in (0, 1) (the rate is multiplied by it), "
                             f"received factor={factor!r}.")
        self.monitor = monitor
        self.factor = factor
        self.patience = non_negative_int("patience", patience)
        self.verbose = verbose
        self.min_delta = abs(finite_float("min_delta", min_delta))
        self.cooldown = non_negative_int("cooldown", cooldown)
        self.min_lr = finite_float("min_lr", min_lr, minimum=0.0)
        self.mode = check_mode(mode, "ReduceLROnPlateau")
        self.monitor_op = monitor_op(monitor, self.mode, "ReduceLROnPlateau")  # None: told when fit starts
        self._restored = False  # state_dict was just loaded for a resumed run (the loop restores before hooks)
        self._reset()

    def _reset(self) -> None:
        self.wait = 0
        self.cooldown_counter = 0
        self.best: float | None = None  # Keras 3: the first value seen is the best so far

    def _improves(self, current: float) -> bool:
        return is_improvement(self.monitor_op, current, self.best, self.min_delta)

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Starts watching afresh, unless state was just restored for a resumed run."""
        if self.monitor_op is None:
            self.monitor_op = monitor_op(self.monitor, self.mode, "ReduceLROnPlateau", self.model, required=True)
        if not self._restored:
            self._reset()
        self._restored = False

    def on_train_end(self, logs: dict | None = None) -> None:
        self._restored = False  # a state restored after on_train_begin (a roll-back) is for this fit only

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Counts the epoch and reduces the rate when patience runs out; logs ``learning_rate``."""
        logs = {} if logs is None else logs
        optimizer = self._require_model().optimizer
        logs["learning_rate"] = float(optimizer.learning_rate)
        current = _to_float(logs.get(self.monitor))
        if not isinstance(current, float):
            warnings.warn(f"Learning rate reduction is conditioned on metric `{self.monitor}` which is not "
                          f"available. Available metrics are: {','.join(logs)}.", stacklevel=2)
            return
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if self._improves(current):
            self.best = current
            self.wait = 0
            return
        if self.cooldown_counter > 0:
            return
        self.wait += 1
        if self.wait < self.patience:
            return
        old_rate = float(optimizer.learning_rate)
        if old_rate > self.min_lr:
            new_rate = max(old_rate * self.factor, self.min_lr)
            optimizer.learning_rate = new_rate
            if self.verbose > 0 and _is_chief(self.model):
                print(f"\nEpoch {epoch + 1}: ReduceLROnPlateau reducing learning rate to {new_rate}.", flush=True)
            self.cooldown_counter = self.cooldown
            self.wait = 0

    def state_dict(self) -> dict[str, Any]:
        """The wait and cooldown counts and the best value so far."""
        return {"wait": self.wait, "cooldown_counter": self.cooldown_counter, "best": best_to_state(self.best)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores `state_dict`'s values; the next `on_train_begin` keeps them."""
        self.wait = int(state["wait"])
        self.cooldown_counter = int(state["cooldown_counter"])
        self.best = best_from_state(state["best"])
        self._restored = True
