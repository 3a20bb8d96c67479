"""Keras 3's exponential moving average of the weights (``use_ema``, ``ema_momentum``,
``ema_overwrite_frequency``), kept by the optimizer and saved in its ``state_dict``.

After each update: ``average = m * average + (1 - m) * weight`` with ``m = ema_momentum`` (``m = 0`` at
the first update, so the average starts as the weights); every ``ema_overwrite_frequency`` updates the
weights are overwritten with their averages; `finalize` (called by ``fit`` when training ends, as
Keras's ``finalize_variable_values``) overwrites them once more.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from meshfit._lazy_dtensor import placed_like
from meshfit.distribute import is_released


def check_ema(use_ema: Any, ema_momentum: Any, ema_overwrite_frequency: Any) -> tuple[bool, float, int | None]:
    """Validated ``(use_ema, ema_momentum, ema_overwrite_frequency)``."""
    if not isinstance(use_ema, bool):
        raise TypeError(f"Invalid `use_ema`: expected a bool, received use_ema={use_ema!r}.")
    if isinstance(ema_momentum, bool) or not isinstance(ema_momentum, (int, float)) or \
            not math.isfinite(ema_momentum) or not 0 <= ema_momentum <= 1:
        raise ValueError(f"Invalid `ema_momentum`: expected a number in [0, 1], received "
                         f"ema_momentum={ema_momentum!r}.")
    if ema_overwrite_frequency is not None and (isinstance(ema_overwrite_frequency, bool) or
                                                not isinstance(ema_overwrite_frequency, int) or
                                                ema_overwrite_frequency < 1):
        raise ValueError("Invalid `ema_overwrite_frequency`: expected an int >= 1 or None, received "
                         f"ema_overwrite_frequency={ema_overwrite_frequency!r}.")
    return use_ema, float(ema_momentum), ema_overwrite_frequency


class MovingAverage:
    """The averages of ``params`` (same shapes, dtypes, devices and layouts)."""

    def __init__(self, params: list[torch.Tensor], momentum: float, overwrite_frequency: int | None) -> None:
        self._params = params
        self._momentum = momentum
        self._overwrite_frequency = overwrite_frequency
        with torch.no_grad():
            # another process's parameter (a pipeline's other stage): its average is its holder's
            self.averages = [p.detach() if is_released(p) else p.detach().clone() for p in params]
            self._held = [(a, p) for a, p in zip(self.averages, params, strict=True) if not is_released(p)]

    @torch.no_grad()
    def update(self, iterations: int) -> None:
        """Fold the weights after update number ``iterations`` (0-based) into the averages."""
        momentum = self._momentum if iterations != 0 else 0.0
        for average, param in self._held:
            average.mul_(momentum).add_(param.detach(), alpha=1.0 - momentum)
        if self._overwrite_frequency and (iterations + 1) % self._overwrite_frequency == 0:
            self.finalize()

    @torch.no_grad()
    def finalize(self) -> None:
        """Overwrite the weights with their averages."""
        for average, param in self._held:
            param.copy_(average)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averages by parameter index."""
        return {str(i): average for i, average in enumerate(self.averages)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`'s averages."""
        if len(state) != len(self.averages):
            raise ValueError(f"Invalid `state_dict`: it holds {len(state)} moving averages for an optimizer of "
                             f"{len(self.averages)} parameters; restore it into the same model.")
        with torch.no_grad():
            for i, (average, param) in enumerate(zip(self.averages, self._params, strict=True)):
                value = state[str(i)]
                if value is not average and not is_released(param):
                    average.copy_(placed_like(value, average))  # a whole average onto a sharded stage's
