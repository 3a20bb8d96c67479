"""Storage mechanisms, one of each: the atomic directory, atomic file writes, "the chief writes, every
rank learns the outcome", CRC-32C checksums and the tagged-JSON codec.

A private layer package: meshfit's other packages import the names below from here, never its
``_``-modules; users import the public names from `meshfit`.
"""

from meshfit._storage import _tagged_json as tagged_json
from meshfit._storage._atomic import (
    AtomicDirectory,
    clean_directory,
    clean_siblings,
    is_scratch_name,
    recover,
    remove_tree,
)
from meshfit._storage._checksum import ChecksumError, CorruptFileError, file_crc32, tensor_crc32, verify_file
from meshfit._storage._chief import ChiefWriteError, chief_writes
from meshfit._storage._io import atomic_directory, atomic_write_bytes, atomic_write_json, fsync_directory
from meshfit._storage._mismatch import StateMismatchError

__all__ = [
    "AtomicDirectory",
    "ChecksumError",
    "ChiefWriteError",
    "CorruptFileError",
    "StateMismatchError",
    "atomic_directory",
    "atomic_write_bytes",
    "atomic_write_json",
    "chief_writes",
    "clean_directory",
    "clean_siblings",
    "file_crc32",
    "fsync_directory",
    "is_scratch_name",
    "recover",
    "remove_tree",
    "tagged_json",
    "tensor_crc32",
    "verify_file",
]
