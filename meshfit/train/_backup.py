"""A backup folder: claimed with a marker, restored from its newest intact checkpoint, deleted safely.

`BackupAndRestore` (and any saver that keeps a folder of its own) uses these three functions::

    backup_dir/
      meshfit_backup.json     the marker: {"format": "meshfit.backup/1"}; written when the folder is claimed
      checkpoint              CheckpointManager's record
      ckpt-11/  ckpt-12/      the checkpoints (and their scratch siblings while saving)

`claim_backup_dir` refuses a non-empty folder that is not a meshfit backup, so `delete_backup_dir`
can never take a user's files with it: it removes the marker, the record and the checkpoints (and
scratch copies of them) only, then the folder if that left it empty.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

from meshfit._storage import CorruptFileError, atomic_write_json, clean_siblings, is_scratch_name, remove_tree

MARKER_FILE = "meshfit_backup.json"
_MARKER = {"format": "meshfit.backup/1"}
_RECORD_FILE = "checkpoint"  # CheckpointManager's state file


def _owned_name(name: str, checkpoint_name: str) -> bool:
    """True for the names a backup folder holds: marker, record, ``<checkpoint_name>-N`` and scratch copies."""
    if name in (MARKER_FILE, _RECORD_FILE) or (name.startswith(_RECORD_FILE + ".tmp-")):
        return True
    stem = re.sub(r"\.(tmp|old|deleting)(-\d+)?$", "", name) if is_scratch_name(name) else name
    return re.fullmatch(rf"{re.escape(checkpoint_name)}-\d+", stem) is not None


def claim_backup_dir(directory: str, checkpoint_name: str = "ckpt") -> None:
    """Chief only: make ``directory`` a meshfit backup folder, or refuse one that holds other files.

    A missing or empty folder is claimed (the marker is written); a folder with the marker, or
    holding only checkpoint names (a backup from before the marker existed), is accepted.

    Raises:
        ValueError: ``directory`` holds files meshfit did not write; the message names the folder
            and some of them.
        NotADirectoryError: ``directory`` is a file.
    """
    clean_siblings(directory)  # a killed process's `<directory>.deleting-<pid>`, a crashed writer's scratch
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(f"Invalid `backup_dir`: expected a folder, received backup_dir={directory!r}, "
                                 "an existing file.")
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    if MARKER_FILE not in names:
        foreign = [n for n in names if not _owned_name(n, checkpoint_name)]
        if foreign:
            raise ValueError(
                f"Invalid `backup_dir`: {directory!r} is not empty and is not a meshfit backup folder (it holds "
                f"{foreign[:5]}{' ...' if len(foreign) > 5 else ''}). BackupAndRestore deletes its folder's "
                "backups when training ends, so give it a folder of its own (a new or empty one).")
    os.makedirs(directory, exist_ok=True)
    if MARKER_FILE not in names:
        atomic_write_json(os.path.join(directory, MARKER_FILE), _MARKER)


def delete_backup_dir(directory: str, checkpoint_name: str = "ckpt") -> None:
    """Chief only: delete what meshfit wrote in ``directory``; the folder too if nothing else is left.

    A folder holding only what meshfit wrote is renamed to ``<directory>.deleting-<pid>`` (the commit:
    from then on no run can resume from it) and its files are unlinked on a thread, off the training
    step: unlinking two fsynced backups of the seed CNN took 20-23 ms here, inside every ``fit``'s end.
    The thread is not a daemon (the interpreter finishes it before exiting); a leftover of a killed
    process is removed when the folder is next claimed. A folder that cannot be renamed (a mount
    point) is emptied in place.
    """
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    if all(_owned_name(name, checkpoint_name) for name in names):
        try:
            remove_tree(directory, background=True)
            return
        except OSError:  # e.g. the folder is a mount point: delete what it holds, below
            pass
    for name in sorted(names, key=lambda n: n == MARKER_FILE):  # the marker last: a crash keeps it claimed
        if _owned_name(name, checkpoint_name):
            remove_tree(os.path.join(directory, name))
    try:
        os.rmdir(directory)
    except OSError:  # the user's files are still there: keep the folder
        pass


def restore_newest_intact(checkpoint: Any, candidates: list[str], is_chief: bool) -> str | None:
    """Restore the newest of ``candidates`` (oldest first) that verifies; None if there is none.

    A checkpoint that fails verification (a data file's checksum, an unreadable state or metadata
    file: `CorruptFileError`) is skipped with a warning on the chief naming it and why; every rank
    reaches the same verdict, since verification is itself collective.
    """
    for path in reversed(candidates):
        try:
            checkpoint.restore(path)
        except CorruptFileError as error:
            if is_chief:
                warnings.warn(f"Skipping the corrupt backup {path!r}: {error} Trying the previous one.",
                              RuntimeWarning, stacklevel=2)
            continue
        return path
    return None
