"""Session-run hooks: TF's ``SessionRunHook`` protocol around each Estimator step.

A hook's ``before_run`` may ask for values by name (``SessionRunArgs(fetches)``): ``"loss"`` (the
step's loss, averaged over replicas), ``"global_step"``, or a key of the ``predictions`` dict the
TRAIN-mode `EstimatorSpec` returned. ``after_run`` gets them in ``run_values.results``.
``run_context.request_stop()`` ends training after this step on every worker. A hook that raises
stops training at once: no checkpoint is written for that step, so the last one stays intact.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from meshfit._validation import invalid_argument, is_int

logger = logging.getLogger("meshfit.estimator")


def log(message: str) -> None:
    """An INFO line, as TF's Estimator logs: through ``logging`` when the application set it up,
    else on stderr (meshfit installs no log handler)."""
    if logging.getLogger().handlers or logger.handlers:
        logger.info(message)
    else:
        print(f"INFO:meshfit.estimator:{message}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class SessionRunArgs:
    """What ``before_run`` asks of the step: ``fetches`` (a name, list or dict of names)."""

    fetches: Any = None
    feed_dict: Any = None
    options: Any = None


@dataclasses.dataclass(frozen=True)
class SessionRunValues:
    """What ``after_run`` receives: ``results`` shaped like the fetches that were asked for."""

    results: Any = None
    options: Any = None
    run_metadata: Any = None


class SessionRunContext:
    """The step being run: ``original_args``, ``request_stop()``, ``stop_requested``."""

    def __init__(self, original_args: SessionRunArgs | None = None, session: Any = None) -> None:
        self.original_args, self.session = original_args, session
        self._stop_requested = False

    def request_stop(self) -> None:
        """End training after this step (agreed with the other workers)."""
        self._stop_requested = True

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested


class SessionRunHook:
    """Base class of hooks into `Estimator.train`, ``evaluate`` and ``predict`` (every method a no-op).

    ``begin()`` before the first step; ``after_create_session(session, coord)`` once the model
    is built and restored (``session`` is the run's `RunState`); ``before_run(run_context)`` and
    ``after_run(run_context, run_values)`` around each step; ``end(session)`` after the last.

    Example:
        >>> class InterruptHook(SessionRunHook):
        ...     def begin(self):
        ...         self._step = -1
        ...     def before_run(self, run_context):
        ...         self._step += 1
        ...     def after_run(self, run_context, run_values):
        ...         if self._step == 5:
        ...             raise RuntimeError("Interruption")
    """

    def begin(self) -> None:
        """Called once before training or evaluation starts."""

    def after_create_session(self, session: Any, coord: Any) -> None:
        """Called once the modules exist and the latest checkpoint is restored."""

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs | None:
        """Called before each step; may return `SessionRunArgs` naming values to fetch."""
        return None

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        """Called after each step with the fetched values."""

    def end(self, session: Any) -> None:
        """Called once at the end (not when a step raised)."""


def fetch(fetches: Any, values: Mapping[str, Any]) -> Any:
    """``fetches`` (a name, or a list/tuple/dict of names) resolved against the step's ``values``."""
    if fetches is None:
        return None
    if isinstance(fetches, str):
        if fetches not in values:
            raise KeyError(f"Cannot fetch {fetches!r}: a step provides {sorted(values)}.")
        return values[fetches]
    if isinstance(fetches, Mapping):
        return {key: fetch(value, values) for key, value in fetches.items()}
    if isinstance(fetches, (list, tuple)):
        return type(fetches)(fetch(value, values) for value in fetches)
    raise TypeError(f"Invalid `fetches`: expected a name or a list/dict of names, received {fetches!r}.")


class StopAtStepHook(SessionRunHook):
    """Request a stop at a global step (``tf.estimator.StopAtStepHook``).

    Args:
        num_steps: stop after this many more steps from where training begins.
        last_step: stop once the global step reaches this. Give exactly one.

    Example:
        >>> StopAtStepHook(last_step=10).last_step
        10
    """

    def __init__(self, num_steps: int | None = None, last_step: int | None = None) -> None:
        if (num_steps is None) == (last_step is None):
            raise ValueError(f"Invalid StopAtStepHook: give exactly one of num_steps and last_step, received "
                             f"num_steps={num_steps!r}, last_step={last_step!r}.")
        for name, value in (("num_steps", num_steps), ("last_step", last_step)):
            if value is not None and (not is_int(value) or value < 0):
                raise invalid_argument(name, "an int >= 0", value)
        self.num_steps, self.last_step = num_steps, last_step

    def after_create_session(self, session: Any, coord: Any) -> None:
        if self.num_steps is not None:
            self.last_step = session.global_step + self.num_steps

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs:
        return SessionRunArgs("global_step")

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        if run_values.results >= self.last_step:
            run_context.request_stop()


def _as_float(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


class LoggingTensorHook(SessionRunHook):
    """Log named values every N steps or seconds (``tf.estimator.LoggingTensorHook``), chief only.

    Args:
        tensors: names to log (see the module docs), as a list or ``{tag: name}``.
        every_n_iter: log every this many steps.
        every_n_secs: or every this many seconds. Give exactly one (or ``at_end`` alone).
        at_end: also log the last values when training ends.
        formatter: ``formatter(dict) -> str`` instead of ``"tag = value, ..."``.

    Example:
        >>> LoggingTensorHook({"loss": "loss"}, every_n_iter=100).every_n_iter
        100
    """

    def __init__(self, tensors: Sequence[str] | Mapping[str, str], every_n_iter: int | None = None,
                 every_n_secs: float | None = None, at_end: bool = False,
                 formatter: Callable[[dict[str, Any]], str] | None = None) -> None:
        if not at_end and (every_n_iter is None) == (every_n_secs is None):
            raise ValueError("Invalid LoggingTensorHook: give exactly one of every_n_iter and every_n_secs (or "
                             f"at_end=True), received every_n_iter={every_n_iter!r}, every_n_secs={every_n_secs!r}.")
        if every_n_iter is not None and (not is_int(every_n_iter) or every_n_iter <= 0):
            raise invalid_argument("every_n_iter", "a positive int", every_n_iter)
        if isinstance(tensors, str):
            tensors = [tensors]
        self.tensors = dict(tensors) if isinstance(tensors, Mapping) else {name: name for name in tensors}
        self.every_n_iter, self.every_n_secs, self.at_end = every_n_iter, every_n_secs, at_end
        self.formatter = formatter
        self._iteration = 0
        self._last_time: float | None = None
        self._last_values: dict[str, Any] | None = None
        self.chief_only = True

    def begin(self) -> None:
        self._iteration, self._last_time = 0, None

    def _due(self) -> bool:
        if self.every_n_iter is not None:
            return self._iteration % self.every_n_iter == 0
        if self.every_n_secs is not None:
            return self._last_time is None or time.monotonic() - self._last_time >= self.every_n_secs
        return False

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs:
        return SessionRunArgs(dict(self.tensors))

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        self._last_values = {tag: _as_float(value) for tag, value in run_values.results.items()}
        if self._due():
            self._log(self._last_values)
        self._iteration += 1

    def _log(self, values: dict[str, Any]) -> None:
        now = time.monotonic()
        if self.formatter is not None:
            text = self.formatter(values)
        else:
            text = ", ".join(f"{tag} = {value:.7g}" if isinstance(value, float) else f"{tag} = {value}"
                             for tag, value in values.items())
            if self._last_time is not None:
                text += f" ({now - self._last_time:.3f} sec)"
        self._last_time = now
        log(text)

    def end(self, session: Any) -> None:
        if self.at_end and self._last_values is not None:
            self._log(self._last_values)


class StepCounterHook(SessionRunHook):
    """Log ``global_step/sec`` every N steps (the Estimator adds one on the chief)."""

    def __init__(self, every_n_steps: int = 100) -> None:
        self.every_n_steps = every_n_steps
        self.chief_only = True
        self._since: tuple[int, float] | None = None

    def after_create_session(self, session: Any, coord: Any) -> None:
        self._since = (session.global_step, time.monotonic())

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs:
        return SessionRunArgs("global_step")

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        if self._since is None:  # begin() sets it
            raise RuntimeError("StepCounterHook.after_run ran before after_create_session.")
        step, (start_step, start_time) = run_values.results, self._since
        if step - start_step >= self.every_n_steps:
            now = time.monotonic()
            rate = (step - start_step) / max(now - start_time, 1e-9)
            log(f"global_step/sec: {rate:.6g}")
            self._since = (step, now)
