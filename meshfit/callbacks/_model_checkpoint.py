"""`ModelCheckpoint`: save the model (or its weights) every epoch or every N batches."""

from __future__ import annotations

import os
import warnings
from typing import Any

from meshfit.callbacks._callback import Callback, _is_chief, _to_float
from meshfit.callbacks._monitor import best_from_state, best_to_state, check_mode, is_improvement, monitor_op


class ModelCheckpoint(Callback):
    """Saves the model or its weights during `fit`, as Keras's `ModelCheckpoint` does.

    Every worker calls ``model.save(path)`` (or ``model.save_weights(path)``): saving is
    collective, and only one copy results. With ``save_best_only`` every worker must see the
    same monitored value, which holds for the logs `fit` reports (reduced over replicas).

    Args:
        filepath: Where to save; may hold ``{epoch}`` (1-based), ``{batch}`` (1-based, for
            batch-level saves) and any log key with a format spec, e.g.
            ``"ckpt/model-{epoch:02d}-{val_loss:.2f}"``.
        monitor: The log key that decides "best", e.g. ``"val_loss"``.
        verbose: 1 prints a line for every save (on the chief only).
        save_best_only: Save only when ``monitor`` improves on the best value so far (the first
            value seen always does). When ``monitor`` is missing from the logs it warns and saves,
            as Keras does.
        save_weights_only: Call ``model.save_weights`` instead of ``model.save``.
        mode: ``"min"``, ``"max"``, or ``"auto"`` (the loss and errors down; accuracy, AUC,
            precision, recall and F1-like metrics up; with ``save_best_only`` another name is an
            error when ``fit`` starts). An unknown mode warns and falls back to ``"auto"``.
        save_freq: ``"epoch"``, or an int: save every that many batches, counted across epochs.
        initial_value_threshold: With ``save_best_only``, a value the first save must beat.

    Raises:
        ValueError: If ``save_freq`` is invalid.
        TypeError: If ``filepath`` is not a string or path.

    Example:
        >>> checkpoint = ModelCheckpoint("ckpt/weights-{epoch:02d}", save_weights_only=True)
        >>> checkpoint.save_freq
        'epoch'
    """

    def __init__(
        self,
        filepath: str | os.PathLike,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        initial_value_threshold: float | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(filepath, (str, os.PathLike)):
            raise TypeError(
                f"Invalid `filepath`: expected a str or os.PathLike, received filepath={filepath!r} "
                f"of type {type(filepath).__name__}."
            )
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1
        ):
            raise ValueError(
                f"Unrecognized save_freq: {save_freq}. Expected save_freq are 'epoch' or integer values. "
                f"Invalid `save_freq`: expected 'epoch' or a positive int, received save_freq={save_freq!r}."
            )
        self.filepath = os.fspath(filepath)
        self.monitor = monitor
        self.verbose = verbose
        self.save_best_only = save_best_only
        self.save_weights_only = save_weights_only
        self.save_freq = save_freq
        self.mode = check_mode(mode, "ModelCheckpoint")
        self.monitor_op = monitor_op(monitor, self.mode, "ModelCheckpoint")  # None: told when fit starts
        # Keras: the threshold, or None (the first value is the best); kept across fit calls.
        self.best = None if initial_value_threshold is None else float(initial_value_threshold)
        self._current_epoch = 0
        self._batches_since_save = 0
        self._last_batch_seen = -1

    stops_in_batch_hooks = False  # its batch hook saves and never stops training

    @property
    def reads_batch_logs(self) -> bool:
        """Only batch-level saves look at a step's logs."""
        return self.save_freq != "epoch"

    def on_train_begin(self, logs: dict | None = None) -> None:
        """With ``save_best_only``, tells the monitor's direction now (an error if it cannot be told)."""
        if self.save_best_only:
            self._require_monitor_op()

    def _require_monitor_op(self) -> None:
        if self.monitor_op is None:
            self.monitor_op = monitor_op(self.monitor, self.mode, "ModelCheckpoint", self.model, required=True)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Remembers the epoch, for ``{epoch}`` in batch-level saves."""
        self._current_epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Saves every ``save_freq`` batches when ``save_freq`` is an int."""
        if not isinstance(self.save_freq, int):  # "epoch"
            return
        if batch <= self._last_batch_seen:  # a new epoch began
            self._batches_since_save += batch + 1
        else:
            self._batches_since_save += batch - self._last_batch_seen
        self._last_batch_seen = batch
        if self._batches_since_save >= self.save_freq:
            self._batches_since_save = 0
            self._save(self._current_epoch, batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Saves when ``save_freq == "epoch"``."""
        if self.save_freq == "epoch":
            self._save(epoch, None, logs)

    def _file_path(self, epoch: int, batch: int | None, logs: dict) -> str:
        fields = dict(logs)
        fields["epoch"] = epoch + 1
        if batch is not None and "batch" not in logs:
            fields["batch"] = batch + 1
        try:
            return self.filepath.format(**fields)
        except (KeyError, IndexError) as error:
            raise ValueError(
                f"Invalid `filepath`: could not format {self.filepath!r} with the keys "
                f"{sorted(fields)} (missing {error}). Use only `epoch`, `batch` and log keys."
            ) from error

    def _save(self, epoch: int, batch: int | None, logs: dict | None) -> None:
        logs = {key: _to_float(value) for key, value in (logs or {}).items()}
        filepath = self._file_path(epoch, batch, logs)
        where = f"Epoch {epoch + 1}" + ("" if batch is None else f", batch {batch + 1}")
        if self.save_best_only:
            current = logs.get(self.monitor)
            self._require_monitor_op()
            best = "None" if self.best is None else f"{self.best:.5f}"
            if current is None:  # Keras warns and saves
                warnings.warn(
                    f"ModelCheckpoint: can save the best model only with `{self.monitor}` available; saving "
                    f"anyway, as Keras does (available keys: {sorted(logs)}).",
                    stacklevel=2,
                )
                self._say(f"{where}: saving model to {filepath}", batch)
            elif not is_improvement(self.monitor_op, current, self.best):
                self._say(f"{where}: {self.monitor} did not improve from {best}", batch)
                return
            else:
                self._say(f"{where}: {self.monitor} improved from {best} to {current:.5f}, "
                          f"saving model to {filepath}", batch)
                self.best = float(current)
        else:
            self._say(f"{where}: saving model to {filepath}", batch)
        dirname = os.path.dirname(filepath)
        if dirname:
            os.makedirs(dirname, exist_ok=True)
        if self.save_weights_only:
            self._require_model().save_weights(filepath)
        else:
            self._require_model().save(filepath)

    def _say(self, message: str, batch: int | None) -> None:
        if self.verbose > 0 and _is_chief(self.model):
            # Mid-epoch the progress bar's line is unfinished: start a new one.
            print(("\n" if batch is not None else "") + message, flush=True)

    def state_dict(self) -> dict[str, Any]:
        """The best value so far and the batch counters."""
        return {
            "best": best_to_state(self.best),
            "batches_since_save": self._batches_since_save,
            "last_batch_seen": self._last_batch_seen,
            "current_epoch": self._current_epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores `state_dict`'s values."""
        self.best = best_from_state(state["best"])
        self._batches_since_save = int(state["batches_since_save"])
        self._last_batch_seen = int(state["last_batch_seen"])
        self._current_epoch = int(state["current_epoch"])
