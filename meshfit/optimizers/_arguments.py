"""The rules an optimizer's arguments are checked by (Keras's names, errors naming the bad value)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshfit._validation import invalid_argument


def check_number(name: str, value: Any, rule: tuple[str, Callable[[float], bool]]) -> float:
    """``value`` as a float where it is a number (not a bool) that keeps ``rule``; else the error naming it."""
    expected, ok = rule
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise invalid_argument(name, expected, value)
    return float(value)


POSITIVE = ("a positive number", lambda v: v > 0)
NON_NEGATIVE = ("a non-negative number", lambda v: v >= 0)
UNIT = ("a number in [0, 1)", lambda v: 0 <= v < 1)


def check_weight_decay(value: Any) -> float | None:
    """A weight decay: None (off) or a non-negative number."""
    return None if value is None else check_number("weight_decay", value, NON_NEGATIVE)


def check_bool(name: str, value: Any) -> bool:
    """``value`` where it is a bool; else a TypeError naming it."""
    if not isinstance(value, bool):
        raise invalid_argument(name, "a bool", value, TypeError)
    return value


def check_mesh(mesh: Any) -> Any:
    """DTensor Keras optimizers take the mesh; here the state takes each parameter's layout by itself."""
    if mesh is None:
        return None
    from meshfit.dtensor import Mesh

    if not isinstance(mesh, Mesh):
        raise TypeError(f"Invalid `mesh`: expected a meshfit.dtensor.Mesh, received mesh={mesh!r}.")
    return mesh
