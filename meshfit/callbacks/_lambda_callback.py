"""`LambdaCallback`: a callback made of plain functions, one per hook."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from meshfit._validation import invalid_argument
from meshfit.callbacks._callback import Callback
from meshfit.callbacks._callback_list import _HOOKS_WITH_INDEX, _HOOKS_WITHOUT_INDEX

# Keras's older names for the training batch hooks.
_ALIASES = {"on_batch_begin": "on_train_batch_begin", "on_batch_end": "on_train_batch_end"}


class LambdaCallback(Callback):
    """Builds a callback from functions, as Keras's ``LambdaCallback`` does.

    Each keyword names a hook and gives the function to call: ``on_epoch_begin(epoch, logs)``,
    ``on_epoch_end(epoch, logs)``, ``on_train_batch_begin(batch, logs)`` (or ``on_batch_begin``),
    ``on_train_batch_end(batch, logs)`` (or ``on_batch_end``), ``on_train_begin(logs)``,
    ``on_train_end(logs)``, and the test and predict hooks likewise. Other keywords become
    attributes of the callback, as in Keras.

    Raises:
        TypeError: If a hook's value is not callable.

    Example:
        >>> seen = []
        >>> callback = LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append((epoch, logs["loss"])))
        >>> callback.on_epoch_end(0, {"loss": 0.5})
        >>> seen
        [(0, 0.5)]
    """

    def __init__(self, **hooks: Callable[..., Any] | None) -> None:
        super().__init__()
        known = set(_HOOKS_WITH_INDEX) | set(_HOOKS_WITHOUT_INDEX)
        for name, function in hooks.items():
            if function is None:
                continue
            hook = _ALIASES.get(name, name)
            if hook not in known:  # Keras keeps any other keyword as an attribute (self.__dict__.update)
                setattr(self, name, function)
                continue
            if not callable(function):
                raise invalid_argument(name, "a function", function, TypeError)
            # Only the hooks given are this callback's own (the others stay the base's empty ones), so the
            # loop calls no hook it was not given: a callback of epoch hooks costs nothing a step.
            setattr(self, hook, _make_hook(function, hook in _HOOKS_WITH_INDEX))


# The hooks a LambdaCallback was given, bound to their functions: partials of module-level functions, so
# that a callback of picklable functions pickles (as Keras's, which keeps the functions themselves).
def _call_with_index(function: Callable[..., Any], index: int, logs: dict | None = None) -> None:
    function(index, logs)


def _call_with_logs(function: Callable[..., Any], logs: dict | None = None) -> None:
    function(logs)


def _make_hook(function: Callable[..., Any], with_index: bool) -> Callable[..., None]:
    return functools.partial(_call_with_index if with_index else _call_with_logs, function)
