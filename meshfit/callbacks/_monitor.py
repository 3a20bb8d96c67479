"""Keras 3's ``MonitorCallback`` rules, shared by `EarlyStopping`, `ModelCheckpoint` and `ReduceLROnPlateau`.

- ``mode`` other than ``"auto"``, ``"min"``, ``"max"``: a warning, then ``"auto"`` (Keras falls back).
- ``"auto"``: the loss is minimised; a compiled metric of that name goes its own way (meshfit's
  metrics and torchmetrics' ``higher_is_better``); well-known names (accuracy, AUC, precision,
  recall, F1 up; errors, hinge, crossentropy, divergence down) are read from the name. Anything
  else is an error (Keras's ValueError), raised when ``fit`` starts.
- ``best`` starts as the baseline (``None`` without one): the first value seen is an improvement.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

Comparison = Callable[[Any, Any], Any]

_HIGHER_IS_BETTER = ("acc", "auc", "precision", "recall", "fmeasure", "f1", "iou", "r2", "true_positives",
                     "true_negatives", "specificity", "sensitivity", "cosine_similarity", "top_k")
_LOWER_IS_BETTER = ("loss", "error", "mse", "mae", "mape", "msle", "rmse", "hinge", "crossentropy", "divergence",
                    "poisson", "logcosh", "log_cosh", "false_positives", "false_negatives")
# meshfit metric classes whose larger values are better, or worse (Keras's `_direction`).
_METRIC_DIRECTION = {"SparseCategoricalAccuracy": "up", "CategoricalAccuracy": "up", "BinaryAccuracy": "up",
                     "Accuracy": "up", "SparseTopKCategoricalAccuracy": "up", "_AutoAccuracy": "up",
                     "_CrossEntropyAccuracy": "up",
                     "MeanSquaredError": "down", "MeanAbsoluteError": "down"}


def check_mode(mode: Any, owner: str) -> str:
    """``mode``, or ``"auto"`` with a warning when it is not one of Keras's three (as Keras does)."""
    if mode in ("auto", "min", "max"):
        return mode
    warnings.warn(f"{owner} mode {mode!r} is unknown, fallback to auto mode (expected 'auto', 'min' or 'max').",
                  stacklevel=3)
    return "auto"


def _from_name(name: str) -> Comparison | None:
    if name == "loss" or name.endswith("_loss"):
        return np.less
    if any(part in name for part in _HIGHER_IS_BETTER):
        return np.greater
    if any(part in name for part in _LOWER_IS_BETTER):
        return np.less
    return None


def _from_model(name: str, model: Any) -> Comparison | None:
    # Probes on purpose: the model is whatever `set_model` was given (Keras drives any model; a stand-in
    # without compiled metrics falls back to the name), and its metrics may be the user's own objects.
    for metric in getattr(model, "metrics", None) or ():
        if getattr(metric, "name", None) != name:
            continue
        higher = getattr(getattr(metric, "metric", None), "higher_is_better", None)  # a torchmetrics metric
        direction = _METRIC_DIRECTION.get(type(metric).__name__)
        if higher is not None:
            return np.greater if higher else np.less
        if direction is not None:
            return np.greater if direction == "up" else np.less
    return None


def monitor_op(monitor: str, mode: str, owner: str, model: Any = None, required: bool = False) -> Comparison | None:
    """``np.greater`` or ``np.less`` for ``mode``; in "auto", from the model's metrics or the name, or None
    while it cannot be told (an error when ``required``)."""
    if mode == "max":
        return np.greater
    if mode == "min":
        return np.less
    name = str(monitor).removeprefix("val_")
    op = _from_model(name, model) or _from_name(name.lower())
    if op is None and required:
        raise ValueError(
            f"Invalid `monitor` for {owner}: in mode='auto' the direction of monitor={monitor!r} cannot be "
            "told (it is neither the loss nor a metric known to be maximised or minimised). Pass mode='max' "
            "to monitor its highest value, or mode='min' for its lowest.")
    return op


def is_improvement(op: Comparison | None, value: float, reference: float | None, min_delta: float = 0.0) -> bool:
    """Whether ``value`` beats ``reference`` by more than ``min_delta`` (anything beats ``None``)."""
    if reference is None:
        return True
    if op is None:  # mode "auto" on a metric named nowhere yet: the callback resolves it when fit starts
        raise RuntimeError("The monitor's mode is not resolved yet: is_improvement needs 'min' or 'max'.")
    delta = -abs(min_delta) if op is np.less else abs(min_delta)
    return bool(op(value - delta, reference))


def best_to_state(best: float | None) -> float:
    """``best`` for a state dict (numbers only): ``None`` is NaN."""
    return math.nan if best is None else float(best)


def best_from_state(value: Any) -> float | None:
    """`best_to_state`'s inverse."""
    value = float(value)
    return None if math.isnan(value) else value
