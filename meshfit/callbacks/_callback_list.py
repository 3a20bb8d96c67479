"""`CallbackList`: fans each Keras hook out to many callbacks, in order, and collects their state."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from meshfit._protocols import RestoresTraining, Stateful
from meshfit.callbacks._callback import Callback
from meshfit.callbacks._history import History
from meshfit.callbacks._progbar_logger import ProgbarLogger

if TYPE_CHECKING:  # annotations only: the model and the loop import the callbacks
    from meshfit._protocols import LoopLike as TrainingLoop
    from meshfit._protocols import ModelLike as Model


#: The base class's batch hooks that call another hook (Keras's older names): a callback implements
#: the first when it overrides either.
_ALIASES = {"on_train_batch_begin": "on_batch_begin", "on_train_batch_end": "on_batch_end"}


def implements_hook(callback: object, hook: str) -> bool:
    """Whether calling ``callback``'s ``hook`` can do anything: the callback (its class, or the instance
    itself) replaces the base class's empty hook, or the older name the base hook calls."""
    for name in (hook, _ALIASES.get(hook)):
        if name is not None and getattr(getattr(callback, name, None), "__func__", None) is not getattr(Callback, name):
            return True
    return False


_HOOKS_WITHOUT_INDEX = (
    "on_train_begin",
    "on_train_end",
    "on_test_begin",
    "on_test_end",
    "on_predict_begin",
    "on_predict_end",
)
_HOOKS_WITH_INDEX = (
    "on_epoch_begin",
    "on_epoch_end",
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_test_batch_begin",
    "on_test_batch_end",
    "on_predict_batch_begin",
    "on_predict_batch_end",
)


class CallbackList:
    """Calls each hook on every callback, in list order.

    Like Keras, a `History` is appended and a `ProgbarLogger` inserted first when asked for,
    unless the user already passed one.

    Args:
        callbacks: `Callback` instances (or one), or None.
        add_history: Append a `History` if none was passed.
        add_progbar: Insert a `ProgbarLogger` first if none was passed.
        model: Model given to every callback's `set_model`.
        **params: Given to every callback's `set_params` (``epochs``, ``steps``, ``verbose``).

    Raises:
        TypeError: If an entry of ``callbacks`` is not a `Callback`.

    Example:
        >>> callbacks = CallbackList(add_history=True, epochs=1, steps=2, verbose=0)
        >>> callbacks.on_train_begin()
        >>> callbacks.on_epoch_end(0, {"loss": 0.5})
        >>> callbacks.history.history
        {'loss': [0.5]}
    """

    def __init__(
        self,
        callbacks: Callback | Iterable[Callback] | None = None,
        add_history: bool = False,
        add_progbar: bool = False,
        model: Model | None = None,
        **params: Any,
    ) -> None:
        if callbacks is None:
            callbacks = []
        elif isinstance(callbacks, Callback):
            callbacks = [callbacks]
        self.callbacks: list[Callback] = []
        self._hooked: dict[str, list[Callback]] = {}  # per batch hook, the callbacks that implement it
        self.model: Model | None = None
        self.params: dict[str, Any] = {}
        for callback in callbacks:
            self.append(callback)
        self._add_default_callbacks(add_history, add_progbar)
        if model is not None:
            self.set_model(model)
        if params:
            self.set_params(params)

    def _add_default_callbacks(self, add_history: bool, add_progbar: bool) -> None:
        # As Keras 3: History, then the progress bar, after the user's callbacks, so that the epoch line
        # shows what they added to the logs (ReduceLROnPlateau's learning_rate)
        self.history = next((c for c in self.callbacks if isinstance(c, History)), None)
        self.progbar = next((c for c in self.callbacks if isinstance(c, ProgbarLogger)), None)
        if self.history is None and add_history:
            self.history = History()
            self.callbacks.append(self.history)
        if self.progbar is None and add_progbar:
            self.progbar = ProgbarLogger(count_mode="steps")
            self.callbacks.append(self.progbar)
        self._order()

    def append(self, callback: Callback) -> None:
        """Adds a callback at the end of the list.

        Raises:
            TypeError: If ``callback`` is not a `Callback`.
        """
        if not isinstance(callback, Callback):
            raise TypeError(
                "Invalid `callbacks`: expected meshfit.callbacks.Callback instances, "
                f"received {callback!r} of type {type(callback).__name__}."
            )
        self.callbacks.append(callback)
        self._order()
        if self.model is not None:
            callback.set_model(self.model)
        if self.params:
            callback.set_params(self.params)

    def _order(self) -> None:
        # Callbacks that save training state (BackupAndRestore) run after all others in every hook,
        # so that what they save includes the others' updates for that step or epoch.
        self.callbacks.sort(key=lambda c: bool(c.run_last))
        self._hooked = {}

    def _callers(self, hook: str) -> list[Callback]:
        """The callbacks whose ``hook`` does something, in order (decided once per fit, or again after
        `append`): a batch hook that only the base class defines is not called at every step."""
        callers = self._hooked.get(hook)
        if callers is None:
            callers = self._hooked[hook] = [c for c in self.callbacks if implements_hook(c, hook)]
        return callers

    def restorer(self) -> RestoresTraining | None:
        """The callback that resumes training (`BackupAndRestore`), which the loop calls before any hook.

        Raises:
            ValueError: two callbacks would each restore training state.
        """
        found = [c for c in self.callbacks if isinstance(c, RestoresTraining)]
        if len(found) > 1:
            raise ValueError(f"Invalid `callbacks`: {found[0]!r} and {found[1]!r} would each restore training state "
                             "when fit starts, but one run resumes from one place. Keep one of them (or give "
                             "the other restore-free checkpoints, such as ModelCheckpoint).")
        return found[0] if found else None

    def set_model(self, model: Model) -> None:
        """Calls `set_model` on every callback."""
        self._hooked = {}
        self.model = model
        for callback in self.callbacks:
            callback.set_model(model)

    def set_params(self, params: Mapping[str, Any]) -> None:
        """Calls `set_params` on every callback."""
        self.params = dict(params)
        for callback in self.callbacks:
            callback.set_params(self.params)

    def set_loop(self, loop: TrainingLoop) -> None:
        """Calls `set_loop` on every callback."""
        self._hooked = {}  # a new fit: which callbacks implement which batch hook is decided again
        for callback in self.callbacks:
            callback.set_loop(loop)

    def batch_logs_needed(self) -> bool:
        """Whether a callback reads per-batch training logs (Keras checks for the override too)."""
        return any(implements_hook(c, "on_train_batch_end") for c in self.callbacks if c.reads_batch_logs)

    def __iter__(self) -> Iterator[Callback]:
        return iter(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)

    # ---- the Keras hooks, each called on every callback in order ----------------------------
    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Calls `on_train_begin` on every callback."""
        logs = {} if logs is None else logs
        for callback in self.callbacks:
            callback.on_train_begin(logs)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        """Calls `on_train_end` on every callback."""
        logs = {} if logs is None else logs
        for callback in self.callbacks:
            callback.on_train_end(logs)

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Calls `on_test_begin` on every callback."""
        logs = {} if logs is None else logs
        for callback in self.callbacks:
            callback.on_test_begin(logs)

    def on_test_end(self, logs: dict[str, Any] | None = None) -> None:
        """Calls `on_test_end` on every callback."""
        logs = {} if logs is None else logs
        for callback in self.callbacks:
            callback.on_test_end(logs)

    def on_predict_begin(self, logs: dict[str, Any] | None = None) -> None:
        """Calls `on_predict_begin` on every callback."""
        logs = {} if logs is None else logs
        for callback in self.callbacks:
            callback.on_predict_begin(logs)

    def on_predict_end(self, logs: dict[str, Any] | None = None) -> None:
        """Calls `on_predict_end` on every callback."""
        logs = {} if logs is None else logs
        for callback in self.callbacks:
            callback.on_predict_end(logs)

    def on_epoch_begin(self, index: int, logs: dict[str, Any] | None = None) -> None:
        """Calls `on_epoch_begin` on every callback."""
        logs = {} if logs is None else logs
        for callback in self.callbacks:
            callback.on_epoch_begin(index, logs)

    def on_epoch_end(self, index: int, logs: dict[str, Any] | None = None) -> None:
        """Calls `on_epoch_end` on every callback."""
        logs = {} if logs is None else logs
        for callback in self.callbacks:
            callback.on_epoch_end(index, logs)

    def on_train_batch_begin(self, index: int, logs: dict[str, Any] | None = None) -> None:
        """Calls `on_train_batch_begin` on every callback that implements it."""
        callers = self._hooked.get("on_train_batch_begin")
        if callers is None:
            callers = self._callers("on_train_batch_begin")
        if not callers:
            return
        logs = {} if logs is None else logs
        for callback in callers:
            callback.on_train_batch_begin(index, logs)

    def on_train_batch_end(self, index: int, logs: dict[str, Any] | None = None) -> None:
        """Calls `on_train_batch_end` on every callback that implements it."""
        callers = self._hooked.get("on_train_batch_end")
        if callers is None:
            callers = self._callers("on_train_batch_end")
        if not callers:
            return
        logs = {} if logs is None else logs
        for callback in callers:
            callback.on_train_batch_end(index, logs)

    def on_test_batch_begin(self, index: int, logs: dict[str, Any] | None = None) -> None:
        """Calls `on_test_batch_begin` on every callback that implements it."""
        callers = self._hooked.get("on_test_batch_begin")
        if callers is None:
            callers = self._callers("on_test_batch_begin")
        if not callers:
            return
        logs = {} if logs is None else logs
        for callback in callers:
            callback.on_test_batch_begin(index, logs)

    def on_test_batch_end(self, index: int, logs: dict[str, Any] | None = None) -> None:
        """Calls `on_test_batch_end` on every callback that implements it."""
        callers = self._hooked.get("on_test_batch_end")
        if callers is None:
            callers = self._callers("on_test_batch_end")
        if not callers:
            return
        logs = {} if logs is None else logs
        for callback in callers:
            callback.on_test_batch_end(index, logs)

    def on_predict_batch_begin(self, index: int, logs: dict[str, Any] | None = None) -> None:
        """Calls `on_predict_batch_begin` on every callback that implements it."""
        callers = self._hooked.get("on_predict_batch_begin")
        if callers is None:
            callers = self._callers("on_predict_batch_begin")
        if not callers:
            return
        logs = {} if logs is None else logs
        for callback in callers:
            callback.on_predict_batch_begin(index, logs)

    def on_predict_batch_end(self, index: int, logs: dict[str, Any] | None = None) -> None:
        """Calls `on_predict_batch_end` on every callback that implements it."""
        callers = self._hooked.get("on_predict_batch_end")
        if callers is None:
            callers = self._callers("on_predict_batch_end")
        if not callers:
            return
        logs = {} if logs is None else logs
        for callback in callers:
            callback.on_predict_batch_end(index, logs)

    def _stateful(self) -> dict[str, Stateful]:
        # Indexed among stateful callbacks only, so adding a stateless one (a ProgbarLogger
        # when verbose changes between runs) does not break a restore.
        stateful = [c for c in self.callbacks if isinstance(c, Stateful)]
        return {f"{index}:{type(c).__name__}": c for index, c in enumerate(stateful)}

    def state_dict(self) -> dict[str, Any]:
        """The state of every callback that has ``state_dict()``.

        Returns:
            ``{"<index>:<ClassName>": callback.state_dict()}``, where index counts only the
            callbacks that have state.
        """
        return {key: callback.state_dict() for key, callback in self._stateful().items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what `state_dict` returned into the same list of callbacks.

        Raises:
            ValueError: If the stateful callbacks differ from the ones that were saved.
        """
        stateful = self._stateful()
        if set(stateful) != set(state):
            raise ValueError(
                "Invalid callback state: the saved callbacks do not match this fit's callbacks "
                f"(expected stateful callbacks {sorted(stateful)}, received {sorted(state)}). "
                "Pass the same callbacks, in the same order, as the run that was saved."
            )
        for key, callback in stateful.items():
            callback.load_state_dict(state[key])
