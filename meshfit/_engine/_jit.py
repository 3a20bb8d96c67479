"""Keras's ``jit_compile`` for torch: whether ``fit``'s training step runs through ``torch.compile``.

Keras compiles its step with XLA where that makes it faster, and runs eagerly where it cannot win
(``"auto"`` turns XLA off on CPU-only machines; its torch backend's ``"auto"`` is eager). meshfit
decides the same way, by device, once at ``compile()``:

- ``"auto"`` (the default, as in Keras 3): eager. A compile costs seconds to minutes before the
  first step, and on the small models we measured it never paid that back (numbers below).
- ``True`` on a GPU: the module is compiled (forward and backward through AOTAutograd), so every
  step runs the compiled graphs; the optimizer keeps torch's fused or foreach kernel (compiling its
  step as well, or the whole step function, measured slower than this on an H200, see
  ``bench/bench_jit.py`` and docs/fragments/keras.md).
- ``True`` on a CPU: eager, with one warning naming ``jit_compile`` and why. On CPU, torch.compile's
  code made the step slower in every case measured: a plain torch step (module, forward+loss, or
  the whole step compiled) of the seed CNN 43-45 vs 18-21 ms and of keras.io's MLP 1.15-1.6 vs
  0.84-0.97 ms, one thread, on the 16-core host of an H200; meshfit's ``fit`` with the module
  compiled 1.60x (CNN) and 1.11x (MLP) slower than eager in ``bench/bench_jit.py`` on this
  project's loaded 2-core machine. ``MESHFIT_JIT_COMPILE_ON_CPU=1`` compiles anyway, for a model
  that measures faster compiled.
- A module torch cannot compile (``True``): the first step raises, naming the module, torch's reason and
  ``jit_compile=False``; meshfit does not fall back to eager where compiling was asked for, and ``"auto"``
  never compiles, so it has nothing to fall back from.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

JIT_ON_CPU_VARIABLE = "MESHFIT_JIT_COMPILE_ON_CPU"

CPU_EAGER_WARNING = (
    "jit_compile=True: on CPU, torch.compile makes a training step slower than eager execution in "
    "every case meshfit measured (seed CNN 2.3x, keras.io's MLP 1.4x), so meshfit runs the step "
    "eagerly, as Keras runs eagerly where XLA cannot win. Set " + JIT_ON_CPU_VARIABLE + "=1 to compile "
    "on CPU anyway, or pass jit_compile=False (or 'auto') to silence this warning.")


def check_jit_compile(value: Any) -> bool | str:
    """``value`` if it is True, False or ``"auto"`` (Keras's values)."""
    if isinstance(value, bool) or value == "auto":
        return value
    raise TypeError(f"Invalid `jit_compile`: expected True, False or 'auto', received jit_compile={value!r}.")


def resolve_jit_compile(value: bool | str, device: torch.device) -> bool:
    """Whether the training step runs compiled on ``device``; warns where True runs eagerly."""
    if value is not True:  # "auto" and False: eager
        return False
    if device.type == "cpu" and os.environ.get(JIT_ON_CPU_VARIABLE, "") != "1":
        warnings.warn(CPU_EAGER_WARNING, UserWarning, stacklevel=3)
        return False
    return True
