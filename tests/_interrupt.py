"""Interrupting training at a step, for the resume tests: a callback or a hook raises ``Interruption``;
or stopping it there, as a user's callback asks fit to stop.

Each interrupter raises ``RuntimeError("Interruption")`` in the process that trains (the tests match that word),
as a crash at that point would end the run; the test then starts again from the backup or checkpoint
and compares with an uninterrupted run. Which hook raises matters: a callback that implements
``on_train_batch_end`` makes fit read the step's logs, and the callbacks listed before it (a
``BackupAndRestore`` among them) have already seen the step when it raises.
"""

from __future__ import annotations

import os
import signal
import time

import meshfit as mf

INTERRUPTION = "Interruption"


class _InterruptAtStep(mf.callbacks.Callback):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def _raise_at_the_step(self) -> None:
        if self.model.loop_state.iterations == self.step:
            raise RuntimeError(INTERRUPTION)


class InterruptAtStepEnd(_InterruptAtStep):
    """Raise in ``on_train_batch_end`` of the step that brings the loop's step count to ``step``."""

    def on_train_batch_end(self, batch, logs=None):
        self._raise_at_the_step()


class InterruptAtStepBegin(_InterruptAtStep):
    """Raise in ``on_train_batch_begin`` once the loop has run ``step`` steps: the next one never starts."""

    def on_train_batch_begin(self, batch, logs=None):
        self._raise_at_the_step()


class StopAfterBatch(mf.callbacks.Callback):
    """Set ``model.stop_training`` in ``on_train_batch_end`` of the epoch's batch ``batch``; built with
    ``asks=False`` (on the processes that do not ask), never: the others must follow the one that asks."""

    def __init__(self, batch: int, asks: bool = True) -> None:
        super().__init__()
        self.batch, self.asks = batch, asks

    def on_train_batch_end(self, batch, logs=None):
        if self.asks and batch == self.batch:
            self.model.stop_training = True


class InterruptHook(mf.estimator.SessionRunHook):
    """An Estimator hook (seed 002's): raises after the sixth run of ``train`` (its step counter reaches 5)."""

    def begin(self):
        self._step = -1

    def before_run(self, run_context):
        self._step += 1

    def after_run(self, run_context, run_values):
        if self._step == 5:
            raise RuntimeError(INTERRUPTION)


class SigkillBeforeStep(mf.callbacks.Callback):
    """SIGKILL this process, when it is rank ``kill_rank``, before optimizer step ``kill_at`` of a launched job's
    first round (``MESHFIT_RESTART_COUNT`` 0: a restarted round trains on), printing ``rank R: SIGKILL at <time>``
    first (a test measures from it)."""

    def __init__(self, kill_rank: int, kill_at: int, rank: int) -> None:
        super().__init__()
        self.kill_rank, self.kill_at, self.rank = kill_rank, kill_at, rank
        self.first_round = os.environ.get("MESHFIT_RESTART_COUNT", "0") == "0"

    def on_train_batch_begin(self, batch, logs=None):
        if self.first_round and self.rank == self.kill_rank and self.model.loop_state.iterations + 1 == self.kill_at:
            print(f"rank {self.rank}: SIGKILL at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
