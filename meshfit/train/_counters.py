"""Step values a `CheckpointManager` reads: ints, NumPy integers, 0-d integer tensors, or callables of those."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from meshfit._validation import is_int


def step_value(value: Any, name: str) -> int:
    """``value`` as a non-negative int: an int, a NumPy integer (or 0-d integer array), a one-element integer
    tensor (TF's integer ``Variable``), or a zero-argument callable returning one of these.

    Raises:
        ValueError: anything else (a float, a bool, a negative number, a tensor of several values...),
            naming ``name`` and the value.
    """
    if callable(value) and not isinstance(value, torch.Tensor | np.ndarray | np.generic):
        value = value()
    number: int | None = None
    if is_int(value):
        number = value
    elif isinstance(value, np.integer):
        number = int(value)
    elif isinstance(value, np.ndarray | torch.Tensor) and value.ndim == 0 or (
            isinstance(value, torch.Tensor) and value.numel() == 1):
        is_integer = (not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool
                      if isinstance(value, torch.Tensor) else np.issubdtype(value.dtype, np.integer))
        if is_integer:
            number = int(value.item())
    if number is None or number < 0:
        shown = f"{value!r} (of type {type(value).__name__})"
        raise ValueError(f"Invalid `{name}`: expected a non-negative int, NumPy integer or 0-d integer tensor, "
                         f"received {name}={shown}.")
    return number


def live_step(value: Any) -> int | None:
    """The current value of a step counter that can be read from any thread without running user code:
    an int or a CPU integer tensor of one element; otherwise None."""
    if is_int(value):
        return int(value)
    if (isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.numel() == 1
            and not value.is_floating_point() and value.dtype != torch.bool):
        return int(value.item())
    return None
