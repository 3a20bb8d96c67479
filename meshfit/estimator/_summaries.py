"""Evaluation results as TensorBoard event files, where TF's Estimator writes them."""

from __future__ import annotations

import os
from typing import Any


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
