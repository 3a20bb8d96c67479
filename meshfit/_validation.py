"""Argument validators shared by every public constructor and function.

Each raises in Keras's house format, naming the argument, what was expected and what was received:
``Invalid `save_freq`: expected 'epoch' or a positive int, received save_freq=-1.``
"""

from __future__ import annotations

import math
import os
from typing import Any


def invalid_argument(name: str, expected: str, value: Any, error: type[Exception] = ValueError) -> Exception:
    """The error for a bad argument, in Keras's house format (raise it: ``raise invalid_argument(...)``)."""
    return error(f"Invalid `{name}`: expected {expected}, received {name}={value!r}.")


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(name: str, value: Any) -> int:
    """``value`` if it is an int > 0."""
    if not is_int(value) or value <= 0:
        raise invalid_argument(name, "a positive int", value)
    return value


def optional_positive_int(name: str, value: Any) -> int | None:
    """``value`` if it is None or an int > 0."""
    if value is None:
        return None
    if not is_int(value) or value <= 0:
        raise invalid_argument(name, "a positive int or None", value)
    return value


def non_negative_int(name: str, value: Any) -> int:
    """``value`` if it is an int >= 0."""
    if not is_int(value) or value < 0:
        raise invalid_argument(name, "an int >= 0", value)
    return value


def epoch_or_positive_int(name: str, value: Any) -> str | int:
    """``"epoch"`` or an int > 0 (Keras's ``save_freq``)."""
    if value == "epoch" and isinstance(value, str):
        return value
    if not is_int(value) or value <= 0:
        raise invalid_argument(name, "'epoch' or a positive int", value)
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool."""
    if not isinstance(value, bool):
        raise invalid_argument(name, "True or False", value, TypeError)
    return value


def finite_float(name: str, value: Any, *, minimum: float | None = None, positive: bool = False) -> float:
    """``value`` as a float if it is a finite real number (NaN and infinity are refused).

    Args:
        name: the argument's name, for the message.
        value: the value received.
        minimum: the smallest allowed value, inclusive.
        positive: require ``value > 0``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid_argument(name, "a finite number", value)
    if positive and value <= 0:
        raise invalid_argument(name, "a number > 0", value)
    if minimum is not None and value < minimum:
        raise invalid_argument(name, f"a number >= {minimum:g}", value)
    return float(value)


def path_like(name: str, value: Any) -> str:
    """``value`` as a ``str`` path if it is a non-empty ``str`` or ``os.PathLike``."""
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise invalid_argument(name, "a non-empty path (str or os.PathLike)", value, TypeError)
    path = os.fspath(value)
    if not isinstance(path, str):
        raise invalid_argument(name, "a str path", value, TypeError)
    return path


def one_of(name: str, value: Any, choices: tuple[Any, ...]) -> Any:
    """``value`` if it is one of ``choices``."""
    if not any(type(value) is type(choice) and value == choice for choice in choices):
        raise invalid_argument(name, "one of " + ", ".join(repr(c) for c in choices), value)
    return value
