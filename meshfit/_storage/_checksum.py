"""CRC-32C checksums of tensors and files, written at save time and verified at load time.

CRC-32C (the ``crc32c`` package: the CPU's CRC instruction where there is one) catches bit flips
and truncation at several GB/s; it is not a defence against deliberate tampering (nothing in a
checkpoint is executed: no pickle is ever loaded).
"""

from __future__ import annotations

import os

import crc32c
import torch

_CHUNK = 1 << 20


def tensor_crc32(tensor: torch.Tensor) -> str:
    """The CRC-32C of a CPU tensor's bytes (any dtype), as 8 hex digits."""
    data = tensor.detach().reshape(-1).contiguous()
    if data.numel() == 0:
        return f"{0:08x}"
    return f"{crc32c.crc32c(data.view(torch.uint8).numpy().data):08x}"


def file_crc32(path: str | os.PathLike) -> str:
    """The CRC-32C of a file's content, as 8 hex digits.

    Reads into one reused buffer: a new bytes object per chunk made this 2.8x slower (11 MB: 7.2 ms
    against 2.6 ms), on the checkpoint writer thread that shares the GIL with training.
    """
    crc = 0
    buffer = memoryview(bytearray(_CHUNK))
    with open(path, "rb", buffering=0) as f:
        while size := f.readinto(buffer):
            crc = crc32c.crc32c(buffer[:size], value=crc)
    return f"{crc:08x}"


class CorruptFileError(ValueError):
    """A saved file is damaged or unreadable (the message names it)."""


class ChecksumError(CorruptFileError):
    """A file's content does not match the checksum recorded when it was written (it is corrupt)."""


def verify_file(path: str | os.PathLike, expected: str) -> None:
    """Raises `ChecksumError` naming ``path`` when its CRC-32C is not ``expected``."""
    actual = file_crc32(path)
    if actual != expected:
        raise ChecksumError(f"Corrupt file {os.fspath(path)!r}: its CRC-32C is {actual}, but {expected} was recorded "
                            "when it was written (a bit flip or a truncated copy). Restore it from a good copy.")
