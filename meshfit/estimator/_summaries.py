"""Evaluation results as TensorBoard event files, where TF's Estimator writes them."""

from __future__ import annotations

import os
import time
from typing import Any

from meshfit.estimator._hooks import SessionRunArgs, SessionRunHook


def eval_dir(model_dir: str, name: str | None) -> str:
    """``model_dir/eval`` or ``model_dir/eval_<name>``."""
    return os.path.join(model_dir, "eval" if not name else f"eval_{name}")


class EventWriters:
    """One TensorBoard writer per directory for an Estimator's life, as TF's ``FileWriterCache``.

    A writer a call makes a new event file; torch names it ``...<seconds>.<host>.<pid>.<n>`` with a
    per-process ``n`` that is not zero-padded, so files made within one second sort ``.10`` before
    ``.9`` and TensorBoard, which reads them in name order, would show later steps first. One file
    per directory keeps the events in the order they were written. Each write is flushed.
    """

    def __init__(self) -> None:
        self._writers: dict[str, Any] = {}

    def get(self, log_dir: str) -> Any:
        """The writer of ``log_dir`` (made on first use)."""
        if log_dir not in self._writers:
            from torch.utils.tensorboard import SummaryWriter

            self._writers[log_dir] = SummaryWriter(log_dir=log_dir)
        return self._writers[log_dir]


def write_eval_summary(writers: EventWriters, model_dir: str, name: str | None, results: dict[str, Any],
                       checkpoint_path: str) -> None:
    """Each scalar result at the checkpoint's global step, and the checkpoint path as text."""
    step = int(results["global_step"])
    writer = writers.get(eval_dir(model_dir, name))
    for key, value in sorted(results.items()):
        if key != "global_step" and isinstance(value, (int, float)):
            writer.add_scalar(key, float(value), global_step=step)
    writer.add_text("checkpoint_path", checkpoint_path, global_step=step)
    writer.flush()



class SummaryHook(SessionRunHook):
    """The chief's training summaries in ``model_dir`` every N steps (TF's ``save_summary_steps``):
    ``loss`` and ``global_step/sec``, as TensorBoard event files."""

    def __init__(self, writers: EventWriters, model_dir: str, every_n_steps: int) -> None:
        self._writers, self.model_dir, self.every_n_steps = writers, model_dir, every_n_steps
        self.chief_only = True
        self._writer: Any = None
        self._since: tuple[int, float] = (0, 0.0)

    def after_create_session(self, session: Any, coord: Any) -> None:
        self._writer = self._writers.get(self.model_dir)
        self._since = (session.global_step, time.monotonic())

    def before_run(self, run_context: Any) -> SessionRunArgs:
        return SessionRunArgs({"loss": "loss", "global_step": "global_step"})

    def after_run(self, run_context: Any, run_values: Any) -> None:
        step, loss = run_values.results["global_step"], run_values.results["loss"]
        if step % self.every_n_steps:
            return
        self._writer.add_scalar("loss", float(loss), global_step=step)
        start_step, start_time = self._since
        now = time.monotonic()
        if step > start_step:
            self._writer.add_scalar("global_step/sec", (step - start_step) / max(now - start_time, 1e-9),
                                    global_step=step)
        self._since = (step, now)

    def end(self, session: Any) -> None:
        if self._writer is not None:
            self._writer.flush()  # the writer stays open for this model_dir's next train()
            self._writer = None
