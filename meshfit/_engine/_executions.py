"""Keras 3's executions: ``steps_per_execution`` steps between two batch-hook calls, in every loop.

An execution at step ``begin`` of an epoch calls ``on_*_batch_begin(begin)`` and
``on_*_batch_end(begin + N - 1)``: Keras's nominal indices, also for a last, partial execution.
It runs ``DataHandler.execution_size`` steps: never past ``steps``, never past the end of a pass
(an epoch ends there, as in Keras 3). Data of unknown length is read until it ends; with several
processes they agree on that end before each step, so that none waits for a step the others skip.
The helpers at the end are what the loop decides once per ``fit`` or per execution rather than at
every step: which batch hooks any callback implements, whether the built-in ``train_step`` runs,
whether the optimizer accumulates gradients.
"""

from __future__ import annotations

import warnings
from typing import Any

from meshfit._engine._data_handler import EndOfData
from meshfit._engine._step_logs import agree
from meshfit._engine._steps import StepsMixin
from meshfit._protocols import Trainable
from meshfit.callbacks import LambdaCallback, ProgbarLogger, implements_hook


def next_batch(trainable: Trainable, data: Any, agree_end: bool | None = None) -> tuple[Any, int] | None:
    """This replica's next batch and the global batch size; None where the data ended (on any replica).

    ``agree_end``: whether the processes agree on the data's end before each step (several processes
    reading data of unknown length); None: decided here (the loop decides once per execution)."""
    try:
        batch, ended = data.next_batch(), False
    except EndOfData:
        batch, ended = None, True
    if agree_end is None:
        agree_end = ends_unknown(trainable, data)
    if agree_end:  # one process, or a known length: nothing to agree
        ended = agree(trainable, ended)
    if ended:
        data.mark_exhausted()
        return None
    return batch


def ends_unknown(trainable: Trainable, data: Any) -> bool:
    """Whether several processes read ``data`` of unknown length (they agree on its end at each step)."""
    return trainable.strategy.num_processes > 1 and not data.length_known


def steps_per_execution(trainable: Trainable) -> int:
    """The trainable's ``steps_per_execution`` (compile's argument; every `Trainable` has one)."""
    return trainable.steps_per_execution


def batch_hooks(cbs: Any) -> tuple[bool, bool]:
    """Whether any callback implements ``on_train_batch_begin`` / ``on_train_batch_end`` (the loop does
    not call a hook no callback implements)."""
    return (any(implements_hook(c, "on_train_batch_begin") for c in cbs),
            any(implements_hook(c, "on_train_batch_end") for c in cbs))


def only_bars_read_batch_ends(cbs: Any) -> bool:
    """Whether every callback with an ``on_train_batch_end`` is a `ProgbarLogger` (which reads the logs
    it is given at once, at the steps it redraws, or not at all)."""
    return all(type(c) is ProgbarLogger for c in cbs if implements_hook(c, "on_train_batch_end"))


def builtin_train_step(trainable: Trainable) -> bool:
    """Whether ``trainable`` steps with `meshfit.Model`'s own ``train_step``, which never sets
    ``stop_training`` (an override, or another trainable's step, may)."""
    return getattr(getattr(trainable, "train_step", None), "__func__", None) is StepsMixin.train_step


def accumulates(trainable: Trainable) -> bool:
    """Whether ``trainable``'s optimizer accumulates gradients over several batches; read once per
    execution (callbacks, which may change it, run between executions)."""
    holder: Any = trainable  # a `Trainable` may have no optimizer (then no accumulation)
    try:  # `getattr` with a default, twice, without its two calls an execution
        steps = holder.optimizer.gradient_accumulation_steps
    except AttributeError:
        return False
    return bool(steps) and steps != 1


def stopping_batch_hooks(cbs: Any) -> bool:
    """Whether a callback implementing a training batch hook may set ``stop_training`` there (every one
    but those whose ``stops_in_batch_hooks`` is False: a saver's batch hook saves and never stops)."""
    return any(getattr(c, "stops_in_batch_hooks", True)
               and (implements_hook(c, "on_train_batch_begin") or implements_hook(c, "on_train_batch_end"))
               for c in cbs)


def warn_hooks_per_execution(cbs: Any, steps_per_execution: int) -> None:
    """Under ``steps_per_execution`` N > 1, say once which of the user's callbacks have training batch
    hooks: ``fit`` calls them once per execution of N steps (Keras's rule), not after every step.
    meshfit's own callbacks (savers, the bar, the history) follow executions as they are meant to."""
    if steps_per_execution <= 1:
        return
    names = [type(c).__name__ for c in cbs
             if (not type(c).__module__.startswith("meshfit.") or type(c) is LambdaCallback)
             and (implements_hook(c, "on_train_batch_begin") or implements_hook(c, "on_train_batch_end"))]
    if names:
        warnings.warn(f"compile(steps_per_execution={steps_per_execution}): fit calls the training batch hooks of "
                      f"{', '.join(names)} once per execution of {steps_per_execution} steps (as Keras does), "
                      "not after every step; `batch` is the execution's first index in on_train_batch_begin and "
                      "its last in on_train_batch_end. Compile with steps_per_execution=1 where a callback needs "
                      "every step.", stacklevel=5)
