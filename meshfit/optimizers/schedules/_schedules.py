"""Keras's learning-rate schedules: the rate as a pure function of the optimizer's step count.

A schedule passed as ``learning_rate=`` to a meshfit optimizer sets the rate before every update
from ``optimizer.batches`` (the steps taken so far: ``optimizer.iterations``, the updates applied,
unless the optimizer accumulates gradients, whose schedule reads every batch as Keras 3's does). The
schedule itself holds no state: its position is saved in the optimizer's ``state_dict``, so a backup
carries it and a resumed run continues on the same curve. Formulas are Keras's.
"""

from __future__ import annotations

import math
from typing import Any

from meshfit._serialization import describe, rebuild
from meshfit._validation import finite_float, non_negative_int, positive_int


class LearningRateSchedule:
    """Base class: ``schedule(step) -> learning rate`` with ``get_config`` / ``from_config``.

    Subclasses implement ``__call__(step)`` (``step`` is the 0-based number of updates applied
    before this one) and ``get_config()`` returning their constructor arguments.

    Example:
        >>> class Halving(LearningRateSchedule):
        ...     def __init__(self, initial_learning_rate):
        ...         self.initial_learning_rate = initial_learning_rate
        ...     def __call__(self, step):
        ...         return self.initial_learning_rate / 2 ** (step // 10)
        ...     def get_config(self):
        ...         return {"initial_learning_rate": self.initial_learning_rate}
        >>> Halving(0.1)(25)
        0.025
    """

    def __call__(self, step: int) -> float:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(step).")

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments, JSON-serialisable."""
        raise NotImplementedError(f"{type(self).__name__} must implement get_config().")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LearningRateSchedule:
        """Builds the schedule from `get_config`'s output."""
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


def _rate(name: str, value: Any) -> float:
    return finite_float(name, value, minimum=0.0)


class ExponentialDecay(LearningRateSchedule):
    """``initial_learning_rate * decay_rate ** (step / decay_steps)`` (integer division when ``staircase``).

    Args:
        initial_learning_rate: The rate at step 0.
        decay_steps: Steps over which the rate is multiplied by ``decay_rate`` once.
        decay_rate: The factor per ``decay_steps``.
        staircase: Decay in discrete jumps every ``decay_steps``.

    Example:
        >>> ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)(20)
        0.025
    """

    def __init__(self, initial_learning_rate: float, decay_steps: int, decay_rate: float,
                 staircase: bool = False) -> None:
        self.initial_learning_rate = _rate("initial_learning_rate", initial_learning_rate)
        self.decay_steps = positive_int("decay_steps", decay_steps)
        self.decay_rate = finite_float("decay_rate", decay_rate, positive=True)
        self.staircase = bool(staircase)

    def __call__(self, step: int) -> float:
        progress = step / self.decay_steps
        if self.staircase:
            progress = math.floor(progress)
        return self.initial_learning_rate * self.decay_rate ** progress

    def get_config(self) -> dict[str, Any]:
        return {"initial_learning_rate": self.initial_learning_rate, "decay_steps": self.decay_steps,
                "decay_rate": self.decay_rate, "staircase": self.staircase}


class PiecewiseConstantDecay(LearningRateSchedule):
    """``values[0]`` up to ``boundaries[0]`` (inclusive), ``values[1]`` up to ``boundaries[1]``, ...

    Args:
        boundaries: Increasing step counts where the rate changes.
        values: One more rate than boundaries.

    Raises:
        ValueError: If the lengths do not match or the boundaries do not increase.

    Example:
        >>> schedule = PiecewiseConstantDecay([100, 200], [1.0, 0.5, 0.1])
        >>> schedule(100), schedule(101), schedule(500)
        (1.0, 0.5, 0.1)
    """

    def __init__(self, boundaries: list[int], values: list[float]) -> None:
        boundaries, values = list(boundaries), list(values)
        if len(values) != len(boundaries) + 1:
            raise ValueError(f"Invalid `values`: expected {len(boundaries) + 1} values (one more than the "
                             f"boundaries), received values={values!r}.")
        if any(b <= a for a, b in zip(boundaries, boundaries[1:], strict=False)):
            raise ValueError(f"Invalid `boundaries`: expected increasing steps, received boundaries={boundaries!r}.")
        self.boundaries = [non_negative_int("boundaries", b) for b in boundaries]
        self.values = [_rate("values", v) for v in values]

    def __call__(self, step: int) -> float:
        for boundary, value in zip(self.boundaries, self.values[:-1], strict=True):
            if step <= boundary:
                return value
        return self.values[-1]

    def get_config(self) -> dict[str, Any]:
        return {"boundaries": list(self.boundaries), "values": list(self.values)}


class CosineDecay(LearningRateSchedule):
    """Cosine decay to ``alpha * peak`` over ``decay_steps``, after an optional linear warm-up.

    Without ``warmup_target`` the rate decays from ``initial_learning_rate``. With it, the rate first
    rises linearly from ``initial_learning_rate`` to ``warmup_target`` over ``warmup_steps``, then
    decays from ``warmup_target`` (Keras 3's ``CosineDecay``).

    Args:
        initial_learning_rate: The rate at step 0.
        decay_steps: Steps of the cosine decay.
        alpha: The final rate as a fraction of the peak.
        warmup_target: The rate reached at the end of the warm-up, or None for no warm-up.
        warmup_steps: Steps of the warm-up.

    Example:
        >>> schedule = CosineDecay(0.0, decay_steps=100, warmup_target=0.1, warmup_steps=10)
        >>> round(schedule(5), 6), round(schedule(10), 6), round(schedule(60), 6), round(schedule(500), 6)
        (0.05, 0.1, 0.05, 0.0)
    """

    def __init__(self, initial_learning_rate: float, decay_steps: int, alpha: float = 0.0,
                 warmup_target: float | None = None, warmup_steps: int = 0) -> None:
        self.initial_learning_rate = _rate("initial_learning_rate", initial_learning_rate)
        self.decay_steps = positive_int("decay_steps", decay_steps)
        self.alpha = finite_float("alpha", alpha, minimum=0.0)
        self.warmup_target = None if warmup_target is None else _rate("warmup_target", warmup_target)
        self.warmup_steps = non_negative_int("warmup_steps", warmup_steps)

    def __call__(self, step: int) -> float:
        peak = self.initial_learning_rate
        if self.warmup_target is not None:
            if step < self.warmup_steps:
                fraction = step / self.warmup_steps
                return self.initial_learning_rate + (self.warmup_target - self.initial_learning_rate) * fraction
            peak, step = self.warmup_target, step - self.warmup_steps
        fraction = min(step, self.decay_steps) / self.decay_steps
        cosine = 0.5 * (1.0 + math.cos(math.pi * fraction))
        return peak * ((1.0 - self.alpha) * cosine + self.alpha)

    def get_config(self) -> dict[str, Any]:
        return {"initial_learning_rate": self.initial_learning_rate, "decay_steps": self.decay_steps,
                "alpha": self.alpha, "warmup_target": self.warmup_target, "warmup_steps": self.warmup_steps}


_CLASSES: dict[str, type[LearningRateSchedule]] = {
    cls.__name__: cls for cls in (ExponentialDecay, PiecewiseConstantDecay, CosineDecay)}


def serialize(schedule: LearningRateSchedule) -> dict[str, Any] | None:
    """``{"class_name": ..., "config": ...}`` for a built-in schedule; None for a user's own class."""
    return describe(schedule, _CLASSES)


def deserialize(config: dict[str, Any],
                custom_objects: dict[str, type[LearningRateSchedule]] | None = None) -> LearningRateSchedule:
    """Rebuilds a schedule from `serialize`'s output (``custom_objects`` adds classes by name)."""
    return rebuild(config, _CLASSES, custom_objects)
