"""Keep memory freed between training steps inside the process (glibc), as a caching allocator does.

Every step frees and re-allocates the same large tensors (activations and their gradients). glibc
serves an allocation above its mmap threshold with a fresh mapping, and returns free memory at the
top of its heap to the system once more than its trim threshold is free; either way the next step's
allocation of the same size page-faults its memory in again: thousands of minor faults a step for
the seed CNN, several milliseconds of a 15 ms step, in some processes and not others (it depends on
the allocation pattern). Fixing the two thresholds (mmap at 32 MiB, trim at 1 GiB) keeps that memory
in the heap for reuse. It is what ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` do.

meshfit applies it when training starts (never at import), once per process, on glibc only. Set
``MESHFIT_KEEP_FREED_MEMORY=0`` to leave the allocator as it is.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 1 << 30
_applied: list[bool] = []


def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process; True if they are set (now or before)."""
    if _applied:
        return _applied[0]
    ok = False
    if sys.platform.startswith("linux") and os.environ.get("MESHFIT_KEEP_FREED_MEMORY", "1") != "0":
        try:
            # The C library this process already runs on (dlopen(NULL)); find_library would run ldconfig.
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):  # not glibc (musl has no mallopt): nothing to tune
            mallopt = None
        if mallopt is not None:
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    _applied.append(ok)
    return ok
