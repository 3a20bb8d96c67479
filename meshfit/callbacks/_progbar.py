"""`Progbar`, Keras's text progress bar (driven by `ProgbarLogger`), and the quiet-worker notice."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TextIO

# Set by `meshfit launch` for its workers when its own stdout is a terminal: the launcher passes
# carriage returns through, so a worker's bar may redraw in place although its stdout is a pipe.
from meshfit._protocols import DistributionStrategy
from meshfit._runtime import FORWARDED_TERMINAL_ENV
from meshfit._validation import finite_float
from meshfit.callbacks._callback import _to_float

# Off a terminal (log files, pipes), a long epoch prints a progress line at most this often.
_FILE_INTERVAL_SECONDS = 30.0


# The bar's clock: a module attribute (read at each call), so that a test can stand in for it.
_now: Callable[[], float] = time.monotonic


def supports_redraw(stream: TextIO) -> bool:
    """Whether ``\\r`` redraws a line: a terminal (also one `meshfit launch` forwards to), or Jupyter."""
    try:
        if stream.isatty():
            return True
    except (AttributeError, ValueError):
        return False
    standard = stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    if standard and os.environ.get(FORWARDED_TERMINAL_ENV) == "1":
        return True
    return "ipykernel" in sys.modules and standard


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) > 1e-3 else f"{value:.4e}"
    return str(value)


def _format_time(seconds: float, unit_name: str) -> str:
    if seconds >= 1 or seconds == 0:
        return f" {seconds:.0f}s/{unit_name}"
    if seconds >= 1e-3:
        return f" {seconds * 1e3:.0f}ms/{unit_name}"
    return f" {seconds * 1e6:.0f}us/{unit_name}"


def _format_eta(seconds: float) -> str:
    whole = int(seconds)
    if whole > 3600:
        return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"
    if whole > 60:
        return f"{whole // 60}:{whole % 60:02d}"
    return f"{whole}s"


class Progbar:
    """Keras's progress bar, in Keras's format.

    With ``verbose=1`` on a terminal the line redraws in place (``\\r``, at most every
    ``interval`` seconds): ``70/70 [==============================] - 1s 7ms/step - loss: 2.2700``.
    On a stream that is not a terminal (a log file, a pipe) it writes no carriage returns: only
    the final line, plus a progress line every ``file_interval`` seconds (30 by default) with the
    step, the time per step and the ETA: ``30/100 [=====>....] - ETA: 1:10 - 1s/step - loss: 1.0000``.
    ``verbose=2`` writes one line when done: ``70/70 - 1s - loss: 2.2700 - 1s/epoch - 7ms/step``.

    Args:
        target: Total number of steps, or None if unknown (shown as ``12/Unknown``).
        width: Width of the bar in characters.
        verbose: 0 (silent), 1 (bar) or 2 (one line at the end).
        interval: Minimum seconds between redraws on a terminal.
        stateful_metrics: Names whose values are shown as given; other values are averaged
            over the steps seen, as Keras does.
        unit_name: The unit in the per-step time, e.g. ``7ms/step``.
        stream: Where to write; None means the current ``sys.stdout``.
        file_interval: Seconds between progress lines off a terminal.

    Raises:
        ValueError: If ``verbose`` is not 0, 1 or 2, ``target`` or ``width`` is negative, or
            ``file_interval`` is not positive.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> bar = Progbar(target=2, verbose=2, stream=out)
        >>> bar.update(2, [("loss", 0.5)])
        >>> out.getvalue().startswith("2/2 - ")
        True
    """

    def __init__(
        self,
        target: int | None,
        width: int = 30,
        verbose: int = 1,
        interval: float = 0.05,
        stateful_metrics: Iterable[str] | None = None,
        unit_name: str = "step",
        stream: TextIO | None = None,
        file_interval: float = _FILE_INTERVAL_SECONDS,
    ) -> None:
        if verbose not in (0, 1, 2):
            raise ValueError(f"Invalid `verbose`: expected 0, 1 or 2, received verbose={verbose!r}.")
        if target is not None and target < 0:
            raise ValueError(f"Invalid `target`: expected None or an int >= 0, received target={target!r}.")
        if width < 1:
            raise ValueError(f"Invalid `width`: expected a positive int, received width={width!r}.")
        self.target = target
        self.width = width
        self.verbose = verbose
        self.interval = interval
        self.stateful_metrics = set(stateful_metrics or ())
        self.unit_name = unit_name
        self.file_interval = finite_float("file_interval", file_interval, positive=True)
        self.stream = sys.stdout if stream is None else stream
        self._dynamic_display = supports_redraw(self.stream)
        self._values: dict[str, Any] = {}
        self._values_order: list[str] = []
        self._seen_so_far = 0
        self._start = _now()
        self._last_update = 0.0
        self._last_file_line = self._start
        self._time_after_first_step: float | None = None
        self._total_width = 0
        self._finalized = False

    def update(
        self,
        current: int,
        values: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
        finalize: bool | None = None,
    ) -> None:
        """Moves the bar to step ``current`` and records metric values.

        Args:
            current: Steps done so far.
            values: ``(name, value)`` pairs or a mapping.
            finalize: Whether this is the last update; default: ``current >= target``.
        """
        if finalize is None:
            finalize = self.target is not None and current >= self.target
        self._record(current, values)
        now = _now()
        if self.verbose == 1:
            self._update_bar(current, now, finalize)
        elif self.verbose == 2 and finalize and not self._finalized:
            self._write(self._one_line(current, now) + "\n")
        self._finalized = self._finalized or finalize

    def draws_at(self, current: int) -> bool:
        """Whether an `update` to ``current`` (not the last) would redraw now; a caller may skip reading
        values the bar would not show."""
        if self.verbose != 1:
            return False
        now = _now()
        if self._dynamic_display:
            return now - self._last_update >= self.interval
        return now - self._last_file_line >= self.file_interval and (self.target is None or current < self.target)

    def pass_to(self, current: int) -> None:
        """Moves the bar to step ``current`` without values or a redraw: what a caller does at a step where
        `draws_at` said no redraw is due (the next redraw shows the values given then)."""
        self._seen_so_far = current

    def add(self, n: int, values: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None) -> None:
        """Advances the bar by ``n`` steps."""
        self.update(self._seen_so_far + n, values)

    def _record(self, current: int, values: Any) -> None:
        items = values.items() if isinstance(values, Mapping) else (values or ())
        for name, raw in items:
            value = _to_float(raw)
            if name not in self._values_order:
                self._values_order.append(name)
            if name in self.stateful_metrics or not isinstance(value, float):
                self._values[name] = value
            else:
                # Weighted by the steps since the last update, so the shown value is a mean per step.
                steps = max(current - self._seen_so_far, 1)
                total, count = self._values.get(name, (0.0, 0))
                self._values[name] = (total + value * steps, count + steps)
        self._seen_so_far = current

    def _metrics_text(self) -> str:
        text = ""
        for name in self._values_order:
            value = self._values[name]
            if isinstance(value, tuple):
                value = value[0] / max(1, value[1])
            text += f" - {name}: {_format_value(value)}"
        return text

    def _step_duration(self, current: int, now: float) -> float:
        if not current:
            return 0.0
        if self._time_after_first_step is not None and current > 1:
            duration = (now - self._time_after_first_step) / (current - 1)
        else:
            duration = (now - self._start) / current
        if current == 1:
            self._time_after_first_step = now
        return duration

    def _bar(self, current: int) -> str:
        if self.target is None:
            return f"{current:7d}/Unknown"
        digits = len(str(self.target))
        bar = f"{current:{digits}d}/{self.target} ["
        progress = min(current / self.target, 1.0) if self.target else 1.0
        filled = int(self.width * progress)
        if filled > 0:
            bar += "=" * (filled - 1) + (">" if current < self.target else "=")
        return bar + "." * (self.width - filled) + "]"

    def _update_bar(self, current: int, now: float, finalize: bool) -> None:
        if not finalize:
            if self._dynamic_display and now - self._last_update < self.interval:
                return
            if not self._dynamic_display and (now - self._last_file_line < self.file_interval
                                              or self.target is not None and current >= self.target):
                return  # in a log, the last step's line is the final one, written at the epoch's end
        duration = self._step_duration(current, now)
        bar = self._bar(current)
        if self.target is None or finalize:
            info = f" - {now - self._start:.0f}s" + _format_time(duration, self.unit_name)
        else:
            info = f" - ETA: {_format_eta(duration * (self.target - current))}"
            if not self._dynamic_display:  # a log line stands alone: say how fast it goes
                info += " -" + _format_time(duration, self.unit_name)
        line = bar + info + self._metrics_text()
        if self._dynamic_display:
            # Pad with spaces so a shorter line fully covers the previous one.
            message = "\r" + line + " " * max(self._total_width - len(line), 0)
            self._total_width = len(line)
            self._write(message + ("\n" if finalize else ""))
        else:
            self._last_file_line = now
            self._write(line + "\n")
        self._last_update = now

    def _one_line(self, current: int, now: float) -> str:
        elapsed = now - self._start
        target = current if self.target is None else self.target
        line = f"{current}/{target} - {elapsed:.0f}s" + self._metrics_text()
        line += " -" + _format_time(elapsed, "epoch")
        return line + " -" + _format_time(elapsed / max(target, 1), self.unit_name)

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


_announced: set[str] = set()


def announce_quiet_worker(strategy: DistributionStrategy, verbose: Any) -> None:
    """On a worker that is not the chief, say once per process that it trains and where logs are.

    Keras prints nothing on such a worker; started by hand in its own terminal (the tutorial's way)
    it would look stuck. Silent with ``verbose=0``.
    """
    if strategy.is_chief or verbose == 0 or "quiet-worker" in _announced:
        return
    _announced.add("quiet-worker")
    print(f"worker {strategy.replica_id}: training with {strategy.num_replicas_in_sync} replicas; progress "
          "and logs are printed by the chief (worker 0).", flush=True)

