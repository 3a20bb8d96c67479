"""`chief_writes`: the chief writes, every rank learns the outcome, every rank raises if it failed."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_OK = "ok"


class ChiefWriteError(RuntimeError):
    """Raised on the ranks that did not write when the chief's write failed."""


def chief_writes(write: Callable[[], T], *, is_chief: bool, gather: Callable[[str], list[str]],
                 what: str) -> T | None:
    """Runs ``write`` on the chief only; returns its result there, None elsewhere.

    Every rank calls this at the same point: ``gather`` (an all-gather of one string per rank) is
    both the barrier that ends the write and how the chief's outcome reaches every rank. The chief
    re-raises its own error; the other ranks raise `ChiefWriteError` quoting it.

    Args:
        write: the chief's action.
        is_chief: whether this rank writes.
        gather: every rank's string, by rank (``[text]`` in a single process).
        what: the action in words, for the error (``"save the model to '/x'"``).

    Raises:
        ChiefWriteError: on a non-chief rank, when the chief's ``write`` failed.
    """
    error: BaseException | None = None
    result: T | None = None
    if is_chief:
        try:
            result = write()
        except BaseException as caught:  # every rank must reach the gather, then we re-raise
            error = caught
    status = "" if not is_chief else (_OK if error is None else f"{type(error).__name__}: {error}")
    statuses = gather(status)
    if error is not None:
        raise error
    failures = [s for s in statuses if s and s != _OK]
    if failures:
        raise ChiefWriteError(f"Could not {what}: the chief failed with {failures[0]}")
    return result
