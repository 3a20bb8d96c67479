"""Evaluation results as TensorBoard event files, where TF's Estimator writes them."""

from __future__ import annotations

import os
import time
from typing import Any

from meshfit.estimator._hooks import SessionRunArgs, SessionRunHook


def eval_dir(model_dir: str, name: str | None) -> str:
    """``model_dir/eval`` or ``model_dir/eval_<name>``."""
    return os.path.join(model_dir, "eval" if not name else f"eval_{name}")


def write_eval_summary(model_dir: str, name: str | None, results: dict[str, Any], checkpoint_path: str) -> None:
    """Each scalar result at the checkpoint's global step, and the checkpoint path as text."""
    from torch.utils.tensorboard import SummaryWriter

    step = int(results["global_step"])
    writer = SummaryWriter(log_dir=eval_dir(model_dir, name))
    try:
        for key, value in sorted(results.items()):
            if key != "global_step" and isinstance(value, (int, float)):
                writer.add_scalar(key, float(value), global_step=step)
        writer.add_text("checkpoint_path", checkpoint_path, global_step=step)
    finally:
        writer.close()



class SummaryHook(SessionRunHook):
    """The chief's training summaries in ``model_dir`` every N steps (TF's ``save_summary_steps``):
    ``loss`` and ``global_step/sec``, as TensorBoard event files."""

    def __init__(self, model_dir: str, every_n_steps: int) -> None:
        self.model_dir, self.every_n_steps = model_dir, every_n_steps
        self.chief_only = True
        self._writer: Any = None
        self._since: tuple[int, float] = (0, 0.0)

    def after_create_session(self, session: Any, coord: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=self.model_dir)
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
            self._writer.close()
            self._writer = None
