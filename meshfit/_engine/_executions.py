"""Keras 3's executions: ``steps_per_execution`` steps between two batch-hook calls, in every loop.

An execution at step ``begin`` of an epoch calls ``on_*_batch_begin(begin)`` and
``on_*_batch_end(begin + N - 1)``: Keras's nominal indices, also for a last, partial execution.
It runs ``DataHandler.execution_size`` steps: never past ``steps``, never past the end of a pass
(an epoch ends there, as in Keras 3). Data of unknown length is read until it ends; with several
processes they agree on that end before each step, so that none waits for a step the others skip.
"""

from __future__ import annotations

from typing import Any

from meshfit._engine._data_handler import EndOfData
from meshfit._engine._step_logs import agree
from meshfit._protocols import Trainable


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
