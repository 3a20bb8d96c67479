"""The calls a piece of code makes, as ``sys.setprofile`` sees them: the interpreter's work, the same on a
loaded machine or under pytest-xdist (the per-step overhead tests count them)."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import Any


def calls_made(run: Callable[[], Any], where: bool = False) -> list[str]:
    """Each call made on this thread while ``run()`` runs, in order: a Python function by its name
    (``"file:name"`` with ``where``), a C function called from Python by its ``__name__``. ``run`` itself
    and the closing ``sys.setprofile`` are left out. The garbage collector is run first and paused while
    ``run()`` runs: the finalizers a collection would call wherever it fell are not the code's calls."""
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            seen.append(f"{code.co_filename}:{code.co_name}" if where else code.co_name)
        elif event == "c_call":
            seen.append(getattr(arg, "__name__", "?"))

    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(previous)
        if collecting:
            gc.enable()
    return seen[1:-1]
