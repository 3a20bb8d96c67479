"""A small tmpfs for disk-full tests (root only; the test is skipped with the reason otherwise)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def small_disk(path, size: str = "256k") -> Iterator:
    """Mount a ``size`` tmpfs at ``path`` for the body, and unmount it afterwards."""
    os.makedirs(path)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                            capture_output=True, timeout=30)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True, timeout=30)
