"""Damaging a saved file on purpose, as a failing disk or a stray write would: the load must notice."""

from __future__ import annotations

import os


def flip_bits(path: str | os.PathLike, offset: int | None = None, mask: int = 0x01) -> None:
    """XOR the byte at ``offset`` of the file at ``path`` (its middle byte by default) with ``mask``, in place."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2 if offset is None else offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ mask]))
