"""torch's intra-op thread count when ``import meshfit`` ran: the baseline for "the user chose threads".

A hand-started worker shares its host's cores unless the user chose torch's thread count, which
includes a ``torch.set_num_threads`` call after ``import meshfit``. meshfit's package loads at its first
public name, so the count is noted here, by the bare ``import meshfit``, when torch is already imported
(``import torch`` first, as scripts do). Imported before torch, meshfit cannot see the count torch
starts with without importing it: then the count at the package's first use is the baseline.
"""

from __future__ import annotations

import sys

__all__ = ["note_threads_at_import", "threads_at_import"]

_noted: int | None = None


def note_threads_at_import() -> None:
    """Note torch's thread count now, if torch is imported (never imports it)."""
    global _noted
    torch = sys.modules.get("torch")
    if _noted is None and torch is not None and hasattr(torch, "get_num_threads"):
        _noted = int(torch.get_num_threads())


def threads_at_import() -> int | None:
    """torch's thread count when ``import meshfit`` ran, or None when torch was not imported yet."""
    return _noted
