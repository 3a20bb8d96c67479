"""`LearningRateScheduler`: set the optimizer's learning rate at the start of every epoch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshfit.callbacks._callback import Callback, _is_chief


class LearningRateScheduler(Callback):
    """Sets the learning rate to ``schedule(epoch, lr)`` before each epoch (Keras semantics).

    ``schedule`` takes the 0-based epoch and the current rate and returns the new rate; a function
    of the epoch alone works too. The rate is logged as ``learning_rate`` at the epoch's end.
    A resumed run (`BackupAndRestore`) does not apply the schedule a second time to the epoch it
    resumes in: the backed-up rate already has it (the callback's state records which epoch it
    last scheduled).

    Args:
        schedule: ``fn(epoch, lr) -> new_lr`` or ``fn(epoch) -> new_lr``.
        verbose: 1 prints each change (on the chief only).

    Raises:
        TypeError: If ``schedule`` is not callable, or returns something other than a number.

    Example:
        >>> scheduler = LearningRateScheduler(lambda epoch, lr: lr if epoch < 10 else lr * 0.9)
        >>> scheduler.schedule(12, 0.1)
        0.09000000000000001
    """

    def __init__(self, schedule: Callable[..., float], verbose: int = 0) -> None:
        super().__init__()
        if not callable(schedule):
            raise TypeError(f"Invalid `schedule`: expected a function of (epoch, lr), received schedule={schedule!r}.")
        self.schedule = schedule
        self.verbose = verbose
        self._scheduled_epoch: int | None = None
        self._restored = False  # state_dict was just loaded for a resumed run (the loop restores before hooks)

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Forgets the last scheduled epoch, unless state was just restored for a resumed run."""
        if not self._restored:
            self._scheduled_epoch = None
        self._restored = False

    def on_train_end(self, logs: dict | None = None) -> None:
        self._restored = False  # a state restored after on_train_begin (a roll-back) is for this fit only

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Applies the schedule, unless this epoch was scheduled before a restore."""
        if self._scheduled_epoch == epoch:
            return
        optimizer = self._require_model().optimizer
        current = float(optimizer.learning_rate)
        try:
            rate = self.schedule(epoch, current)
        except TypeError:  # a schedule of the epoch alone (Keras accepts both)
            rate = self.schedule(epoch)
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) and not hasattr(rate, "item"):
            raise TypeError(f"LearningRateScheduler: the schedule must return a number, received {rate!r} "
                            f"for epoch {epoch}.")
        optimizer.learning_rate = float(rate)
        self._scheduled_epoch = epoch
        if self.verbose > 0 and _is_chief(self.model):
            print(f"\nEpoch {epoch + 1}: LearningRateScheduler setting learning rate to {float(rate)}.",
                  flush=True)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Adds ``learning_rate`` to the epoch's logs."""
        if logs is not None:
            logs["learning_rate"] = float(self._require_model().optimizer.learning_rate)

    def state_dict(self) -> dict[str, Any]:
        """The last epoch the schedule was applied to (-1 for none)."""
        return {"scheduled_epoch": -1 if self._scheduled_epoch is None else self._scheduled_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the last scheduled epoch; the next `on_train_begin` keeps it."""
        epoch = int(state["scheduled_epoch"])
        self._scheduled_epoch = None if epoch < 0 else epoch
        self._restored = True
