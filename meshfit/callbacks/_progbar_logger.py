"""`ProgbarLogger`: the callback that drives Keras's progress bar during fit, evaluate and predict."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TextIO

from meshfit._validation import finite_float
from meshfit.callbacks._callback import Callback
from meshfit.callbacks._progbar import _FILE_INTERVAL_SECONDS, Progbar


class ProgbarLogger(Callback):
    """Prints Keras's progress bar during `fit`, `evaluate` and `predict`.

    `fit` adds one itself; it reads ``params["verbose"]`` (0 silent, 1 bar, 2 one line per
    epoch) and ``params["steps"]`` (None when unknown). Before each epoch it prints
    ``Epoch 1/3`` (when there is more than one epoch); at the end of an epoch the line shows the
    training and ``val_`` metrics from the epoch's logs. The logs a step reports are shown as
    given (they are the epoch's running values, as in Keras). On a terminal the bar redraws in
    place; written to a file or pipe it prints no carriage returns (see `Progbar`).

    Args:
        count_mode: ``"steps"`` counts batches; ``"samples"`` counts the ``size`` in each step's
            logs against ``params["samples"]``.
        stream: Where to write; None means the current ``sys.stdout``.
        stateful_metrics: Log names always shown as given (the logs of `fit` already are).
        interval: Minimum seconds between redraws on a terminal.
        file_interval: Seconds between progress lines (step, time per step, ETA) off a terminal;
            each epoch's final line is always written.

    Raises:
        ValueError: If ``count_mode`` is not ``"steps"`` or ``"samples"``, or an interval is not
            a positive number.

    Example:
        >>> logger = ProgbarLogger(file_interval=10)  # in a log file: a progress line every 10 s
        >>> logger.file_interval
        10.0
    """

    stops_in_batch_hooks = False  # it prints; it never stops a loop

    @property
    def reads_batch_logs(self) -> bool:
        """Only the live bar (``verbose=1``) shows per-batch values; ``verbose=2`` prints epochs."""
        return self.verbose == 1

    @property
    def reads_test_batch_logs(self) -> bool:
        """Whether ``on_test_batch_end`` reads its logs: the live bar of an ``evaluate`` outside ``fit``
        (``fit``'s validation draws no bar, so its steps need no reduced logs)."""
        return self.verbose == 1 and not self._called_in_fit

    def __init__(self, count_mode: str = "steps", stream: TextIO | None = None,
                 stateful_metrics: Iterable[str] | None = None, interval: float = 0.05,
                 file_interval: float = _FILE_INTERVAL_SECONDS) -> None:
        super().__init__()
        self.stateful_metrics = set(stateful_metrics or ())
        self.interval = finite_float("interval", interval, positive=True)
        self.file_interval = finite_float("file_interval", file_interval, positive=True)
        if count_mode not in ("steps", "samples"):
            raise ValueError(
                f"Invalid `count_mode`: expected 'steps' or 'samples', received count_mode={count_mode!r}."
            )
        self.use_steps = count_mode == "steps"
        self.stream = stream
        self.verbose = 1
        self.epochs = 1
        self.target: int | None = None
        self.seen = 0
        self.progbar: Progbar | None = None
        self._called_in_fit = False

    def set_params(self, params: Mapping[str, Any]) -> None:
        """Reads ``verbose``, ``epochs`` and ``steps`` (or ``samples``)."""
        super().set_params(params)
        verbose = params.get("verbose", 1)
        if verbose not in (0, 1, 2):
            raise ValueError(f"Invalid `verbose`: expected 0, 1 or 2, received verbose={verbose!r}.")
        self.verbose = verbose
        self.epochs = params.get("epochs", 1)
        self.target = params.get("steps") if self.use_steps else params.get("samples")

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Marks that validation runs inside `fit`, whose results the epoch line shows."""
        self._called_in_fit = True

    def on_train_end(self, logs: dict | None = None) -> None:
        """Ends the `fit` call, so a later `evaluate` shows its own bar."""
        self._called_in_fit = False

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Starts a new bar and prints ``Epoch i/n``."""
        self._reset()
        if self.verbose and self.epochs > 1:
            self._new_progbar()._write(f"Epoch {epoch + 1}/{self.epochs}\n")

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Finishes the bar with the epoch's training and validation metrics."""
        self._finalize(logs)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Advances the bar."""
        self._batch_update(batch, logs)

    def on_test_begin(self, logs: dict | None = None) -> None:
        """Starts a bar for `evaluate` (validation inside `fit` has none)."""
        if not self._called_in_fit:
            self._reset()

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Advances the `evaluate` bar."""
        if not self._called_in_fit:
            self._batch_update(batch, logs)

    def on_test_end(self, logs: dict | None = None) -> None:
        """Finishes the `evaluate` bar with its metrics."""
        if not self._called_in_fit:
            self._finalize(logs)

    def on_predict_begin(self, logs: dict | None = None) -> None:
        """Starts a bar for `predict`."""
        self._reset()

    def on_predict_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Advances the `predict` bar (predictions are not shown)."""
        self._batch_update(batch, None)

    def on_predict_end(self, logs: dict | None = None) -> None:
        """Finishes the `predict` bar."""
        self._finalize(None)

    def _reset(self) -> None:
        self.seen = 0
        self.progbar = None

    def _new_progbar(self) -> Progbar:
        if self.progbar is None:
            self.progbar = Progbar(
                target=self.target,
                verbose=self.verbose,
                unit_name="step" if self.use_steps else "sample",
                stream=self.stream,
                interval=self.interval,
                stateful_metrics=set(self.stateful_metrics),
                file_interval=self.file_interval,
            )
        return self.progbar

    def _display_logs(self, logs: dict | None) -> dict:
        logs = dict(logs or {})
        for key in ("size", "num_steps", "batch"):
            logs.pop(key, None)
        return logs

    def _batch_update(self, batch: int, logs: dict | None) -> None:
        progbar = self.progbar or self._new_progbar()
        if self.use_steps:
            self.seen = batch + 1
        else:
            logs = logs or {}
            self.seen += int(logs.get("num_steps", 1)) * int(logs.get("size", 0))
        if self.verbose == 1:
            if not progbar.draws_at(self.seen):  # logs read only where shown: fit may reduce them on reading
                progbar.pass_to(self.seen)
                return
            logs = self._display_logs(logs)
            progbar.stateful_metrics.update(logs)
            progbar.update(self.seen, logs, finalize=False)

    def _finalize(self, logs: dict | None) -> None:
        progbar = self._new_progbar()
        if self.target is None:
            # An unknown length is known once the first pass ends; later bars use it.
            self.target = self.seen
            progbar.target = self.seen
        logs = self._display_logs(logs)
        progbar.stateful_metrics.update(logs)
        progbar.update(self.target, logs, finalize=True)
