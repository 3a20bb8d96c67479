"""`Callback`, the Keras hook interface, and `CallbackList`, which fans each hook out to many."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the model and the loop import the callbacks
    from meshfit._protocols import LoopLike as TrainingLoop
    from meshfit._protocols import ModelLike as Model


class Callback:
    """Base class for objects that hook into `Model.fit`, `evaluate` and `predict`.

    Every hook is a no-op; subclasses override the ones they need. The hook names and
    arguments are Keras's, so Keras callbacks port by changing the import. A callback with
    state it needs after a restart (for `BackupAndRestore`) also defines ``state_dict()`` and
    ``load_state_dict(state)``.

    Attributes:
        model: The `meshfit.Model` being trained, set by `set_model`.
        loop: The `TrainingLoop` running ``fit``, set by `set_loop` (None in evaluate/predict).
        params: Training parameters set by `set_params`: ``epochs``, ``steps``, ``verbose``.

    Example:
        >>> class CountEpochs(Callback):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.count = 0
        ...     def on_epoch_end(self, epoch, logs=None):
        ...         self.count += 1
        >>> callback = CountEpochs()
        >>> callback.on_epoch_end(0, {"loss": 1.0})
        >>> callback.count
        1
    """

    @property
    def reads_batch_logs(self) -> bool:
        """Whether ``on_train_batch_end`` reads its ``logs``. The loop reduces metrics across replicas
        at every step only when some callback does; one that overrides the hook for another reason
        (saving every N steps) sets ``reads_batch_logs = False`` in its class (or overrides this)."""
        return True

    #: Whether this callback's batch hooks may set ``model.stop_training`` (or roll training back), or
    #: ``stop_evaluating`` / ``stop_predicting`` in its test / predict batch hooks. On several workers, a
    #: loop with such a hook shares the stop flag after every step, so that all stop at the same one; a
    #: callback whose batch hooks never stop (a saver, the progress bar) sets it False in its class, and
    #: then costs no collective a step.
    stops_in_batch_hooks = True

    #: Whether this callback runs after every other one in each hook (savers: what they save then
    #: includes the others' updates for that step or epoch).
    run_last = False
    def __init__(self) -> None:
        self.model: Model | None = None
        self.loop: TrainingLoop | None = None
        self.params: dict[str, Any] = {}

    def set_model(self, model: Model) -> None:
        """Sets the model the callback observes."""
        self.model = model

    def set_params(self, params: Mapping[str, Any]) -> None:
        """Sets the training parameters (``epochs``, ``steps``, ``verbose``)."""
        self.params = dict(params)

    def set_loop(self, loop: TrainingLoop) -> None:
        """Sets the `TrainingLoop` running ``fit`` (its counters, data position and saveable state)."""
        self.loop = loop

    @property
    def handles_preemption(self) -> bool:
        """Whether the loop should watch for preemption and call `save_for_preemption` (`BackupAndRestore`)."""
        return False

    def save_for_preemption(self) -> None:
        """Saves a backup now: every worker stopped at the same step because the job is preempted."""

    def _require_model(self) -> Model:
        """The model, for hooks that run only once `set_model` was called."""
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__} has no model: call set_model(model) before its hooks.")
        return self.model

    def _require_loop(self) -> TrainingLoop:
        """The training loop, for hooks that run only inside ``fit``."""
        if self.loop is None:
            raise RuntimeError(f"{type(self).__name__} needs the training loop: it works only inside fit().")
        return self.loop

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Called once at the start of `fit`."""

    def on_train_end(self, logs: dict | None = None) -> None:
        """Called once at the end of `fit`."""

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Called at the start of each epoch (``epoch`` is 0-based)."""

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Called at the end of each epoch; ``logs`` holds training and ``val_`` metrics."""

    def on_test_begin(self, logs: dict | None = None) -> None:
        """Called at the start of `evaluate` (and of validation within `fit`)."""

    def on_test_end(self, logs: dict | None = None) -> None:
        """Called at the end of `evaluate` (and of validation within `fit`)."""

    def on_predict_begin(self, logs: dict | None = None) -> None:
        """Called at the start of `predict`."""

    def on_predict_end(self, logs: dict | None = None) -> None:
        """Called at the end of `predict`."""

    def on_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Keras's older name: called by the default `on_train_batch_begin`."""

    def on_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Keras's older name: called by the default `on_train_batch_end`."""

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Called before each training step (``batch`` is the 0-based index in the epoch).

        By default it calls `on_batch_begin`, as in Keras.
        """
        self.on_batch_begin(batch, logs=logs)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Called after each training step; ``logs`` holds the epoch's running metrics.

        By default it calls `on_batch_end`, as in Keras.
        """
        self.on_batch_end(batch, logs=logs)

    def on_test_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Called before each evaluation step."""

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Called after each evaluation step."""

    def on_predict_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Called before each prediction step."""

    def on_predict_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Called after each prediction step."""


def _to_float(value: Any) -> Any:
    """A Python float for scalar numbers, tensors and arrays; anything else unchanged."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    size = getattr(value, "numel", None) or getattr(value, "size", None)
    try:
        count = size() if callable(size) else size
        if count == 1 and hasattr(value, "item"):
            return float(value.item())
    except (TypeError, ValueError, RuntimeError):
        pass
    return value


def _is_chief(model: Model | None) -> bool:
    """Whether this process writes shared files: True without a model or strategy."""
    # A probe on purpose: Keras callbacks drive whatever `set_model` was given, and a model of the
    # user's own without a strategy is one process, the chief (tests/test_callbacks.py holds this).
    strategy = getattr(model, "strategy", None)
    return True if strategy is None else bool(strategy.is_chief)
