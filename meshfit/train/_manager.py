"""`CheckpointManager` and `latest_checkpoint`: numbered checkpoints in a directory, pruned."""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any, Literal, overload

import torch

from meshfit._storage import atomic_write_json, remove_tree
from meshfit.distribute import current_world
from meshfit.train import _storage
from meshfit.train._backup import restore_newest_intact
from meshfit.train._checkpoint import Checkpoint, _wait_for_pending_save
from meshfit.train._save_future import SaveFuture

STATE_FILE_NAME = "checkpoint"


def latest_checkpoint(directory: str | os.PathLike, checkpoint_name: str | None = None) -> str | None:
    """The newest complete checkpoint directory in ``directory``, or None if there is none.

    Only complete checkpoints count (final name, DCP ``.metadata`` and meshfit's JSON state):
    ``*.tmp`` directories and interrupted saves are ignored, so this never returns a partial one.

    Args:
        directory: where to look (not recursively).
        checkpoint_name: only consider ``<checkpoint_name>-N`` directories (newest = largest ``N``).
            With None, any complete directory counts: numbered ones (``<anything>-N``) before
            unnumbered ones, by ``N``, then by modification time.

    Returns:
        The absolute path, or None.

    Example:
        >>> import tempfile
        >>> from meshfit.train import latest_checkpoint
        >>> latest_checkpoint(tempfile.mkdtemp()) is None
        True
    """
    found = _storage.complete_checkpoints(os.path.abspath(os.fspath(directory)), checkpoint_name)
    return found[-1] if found else None


class CheckpointManager:
    """Saves numbered checkpoints ``<directory>/<checkpoint_name>-N`` and keeps the newest few.

    The truth is the set of complete checkpoint directories on disk: a manager created after a
    crash finds them (partial ones are ignored) and continues numbering after the largest ``N``.
    After each save, rank 0 also writes ``<directory>/checkpoint`` (JSON, atomically) for people
    and tools::

        {"latest_checkpoint": "ckpt-7", "all_checkpoints": ["ckpt-5", "ckpt-6", "ckpt-7"]}

    Every rank must create the manager and call ``save`` / ``restore_or_initialize`` together.

    Args:
        checkpoint: the :class:`Checkpoint` to save.
        directory: where checkpoints go (created on first save).
        max_to_keep: how many complete checkpoints to keep; older ones are deleted by rank 0 after
            each save (never the one just written). None keeps all.
        checkpoint_name: the directory name prefix.
        step_counter: optional; when given and ``save`` gets no ``checkpoint_number``, checkpoints
            are numbered with its current value: an int, a 0-d integer tensor, anything ``int()``
            accepts, or a zero-argument callable returning one.

    Raises:
        TypeError: ``checkpoint`` is not a ``Checkpoint``.
        ValueError: ``max_to_keep`` or ``checkpoint_name`` is invalid.

    Example:
        >>> import tempfile, torch
        >>> from meshfit.train import Checkpoint, CheckpointManager
        >>> step = torch.tensor(0)
        >>> manager = CheckpointManager(Checkpoint(step=step), tempfile.mkdtemp(), max_to_keep=2)
        >>> for _ in range(3):
        ...     _ = step.add_(1)
        ...     _ = manager.save()
        >>> [p.rsplit("/", 1)[1] for p in manager.checkpoints]
        ['ckpt-2', 'ckpt-3']
        >>> _ = step.zero_()
        >>> manager.restore_or_initialize().endswith("ckpt-3"), int(step)
        (True, 3)
    """

    def __init__(self, checkpoint: Checkpoint, directory: str | os.PathLike, max_to_keep: int | None = 5,
                 checkpoint_name: str = "ckpt", step_counter: Any = None) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"Invalid `checkpoint`: expected a meshfit.train.Checkpoint, received "
                            f"{type(checkpoint).__name__}. Build one with Checkpoint(model=..., optimizer=...).")
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int)
                                        or max_to_keep < 1):
            raise ValueError(f"Invalid `max_to_keep`: expected a positive int or None, received "
                             f"max_to_keep={max_to_keep!r}.")
        if (not isinstance(checkpoint_name, str) or not checkpoint_name or "/" in checkpoint_name
                or os.sep in checkpoint_name):
            raise ValueError(f"Invalid `checkpoint_name`: expected a non-empty name without path "
                             f"separators, received checkpoint_name={checkpoint_name!r}.")
        self._checkpoint = checkpoint
        self._directory = os.path.abspath(os.fspath(directory))
        self._max_to_keep = max_to_keep
        self._name = checkpoint_name
        self._step_counter = step_counter
        self._lock = threading.Lock()
        _wait_for_pending_save()  # an async save still in flight (an interrupted fit's) lands before the scan
        self._kept = _storage.complete_checkpoints(self._directory, checkpoint_name)
        numbers = [_storage.checkpoint_number(os.path.basename(p), checkpoint_name) or 0 for p in self._kept]
        self._next_number = max(numbers, default=0) + 1

    @property
    def directory(self) -> str:
        """The absolute checkpoint directory."""
        return self._directory

    @property
    def checkpoint(self) -> Checkpoint:
        """The managed :class:`Checkpoint`."""
        return self._checkpoint

    @property
    def checkpoints(self) -> list[str]:
        """Kept checkpoint paths, oldest first (an async save appears once it is complete)."""
        with self._lock:
            return list(self._kept)

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest kept checkpoint path, or None."""
        with self._lock:
            return self._kept[-1] if self._kept else None

    @overload
    def save(self, checkpoint_number: int | None = None, async_save: Literal[False] = False) -> str: ...

    @overload
    def save(self, checkpoint_number: int | None = None, *, async_save: Literal[True]) -> SaveFuture: ...

    def save(self, checkpoint_number: int | None = None, async_save: bool = False) -> str | SaveFuture:
        """Save ``<directory>/<checkpoint_name>-N`` (collective), then prune and update the state file.

        A complete checkpoint's identity is immutable: ``<checkpoint_name>-N`` always holds what the
        save numbered ``N`` wrote, so a number that already names a complete checkpoint is refused
        rather than overwritten (a kill during an overwrite could otherwise leave ``ckpt-1`` holding
        a newer step than the save that was acknowledged as ``ckpt-1``).

        Args:
            checkpoint_number: ``N``; by default the step counter's value if there is one, else one
                more than the largest ``N`` saved or found.
            async_save: write in the background (see :meth:`Checkpoint.save`); the new checkpoint
                joins :attr:`checkpoints` and pruning happens when the write completes.

        Returns:
            The path written, or a :class:`SaveFuture` resolving to it.

        Raises:
            ValueError: ``checkpoint_number`` (or the step counter) is not a non-negative int.
            FileExistsError: ``<checkpoint_name>-N`` is already a complete checkpoint.
        """
        _wait_for_pending_save()  # an async save in flight completes (and is recorded) first
        number = self._number(checkpoint_number)
        path = os.path.join(self._directory, f"{self._name}-{number}")
        if _storage.is_complete(path):
            source = "checkpoint_number" if checkpoint_number is not None or self._step_counter is None \
                else "step_counter"
            raise FileExistsError(
                f"Invalid `{source}`: {path!r} is already a complete checkpoint (number {number}). A "
                "checkpoint's content never changes once it is complete, so its number is not reused. Save "
                f"under a new number (save() with no number uses {max(self._next_number, number + 1)}), or "
                "remove that checkpoint first if it is really meant to be replaced.")
        self._next_number = max(self._next_number, number + 1)
        return self._checkpoint.save(path, async_save=async_save, on_commit=self._record)

    def restore_or_initialize(self) -> str | None:
        """Restore the latest checkpoint if there is one (collective).

        A checkpoint that fails verification (a data file's checksum, an unreadable state file) is
        skipped with a warning naming it and why, and the newest one that verifies is restored.

        Returns:
            The restored path, or None when there is nothing to restore (the objects keep their
            freshly initialised state).

        Raises:
            CorruptFileError: every checkpoint failed verification (the message names the newest).
        """
        candidates = self.checkpoints
        if not candidates:
            return None
        rank = self._rank()
        restored = restore_newest_intact(self._checkpoint, candidates, is_chief=rank == 0)
        if restored is None:
            self._checkpoint.restore(candidates[-1])  # raises the newest one's error
        return restored

    def __repr__(self) -> str:
        return (f"CheckpointManager(directory={self._directory!r}, max_to_keep={self._max_to_keep}, "
                f"checkpoint_name={self._name!r}, latest={self.latest_checkpoint!r})")

    def _number(self, checkpoint_number: int | None) -> int:
        """The ``N`` for the next save."""
        source = "checkpoint_number"
        value: Any = checkpoint_number
        if value is None and self._step_counter is not None:
            source = "step_counter"
            value = self._step_counter() if callable(self._step_counter) else self._step_counter
            if isinstance(value, torch.Tensor):
                value = value.item() if value.numel() == 1 and not value.is_floating_point() else value
            elif not isinstance(value, int):
                value = int(value)
        if value is None:
            return self._next_number
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"Invalid `{source}`: expected a non-negative int, received {value!r}.")
        return value

    def _rank(self) -> int:
        """This process's rank in the job the checkpoint saves in (its `World`)."""
        world = self._checkpoint.world
        return (world if world is not None else current_world()).rank

    def _record(self, path: str, own_copy: bool = False) -> None:
        """After ``path`` is complete on every rank: remember it, prune, write the state file (rank 0,
        or every rank when each saved its own copy to its own directory)."""
        rank = self._rank()
        with self._lock:
            self._kept = [p for p in self._kept if p != path] + [path]
            doomed: list[str] = []
            if self._max_to_keep is not None:
                while len(self._kept) > self._max_to_keep:
                    doomed.append(self._kept.pop(0))
            kept = list(self._kept)
        if rank != 0 and not own_copy:
            return
        for old in doomed:
            # In the foreground: a checkpoint is a few files (one per writing rank), so unlinking them
            # is cheap, and a caller listing the folder after save() returns sees only kept checkpoints.
            _best_effort(functools.partial(remove_tree, old),
                         f"delete old checkpoint {old!r}")
        state = {"latest_checkpoint": os.path.basename(path),
                 "all_checkpoints": [os.path.basename(p) for p in kept]}
        _best_effort(lambda: atomic_write_json(os.path.join(self._directory, STATE_FILE_NAME), state),
                     f"write {os.path.join(self._directory, STATE_FILE_NAME)!r}")


def _best_effort(action: Callable[[], None], what: str) -> None:
    """Housekeeping after a complete save: a failure is reported, the new checkpoint stays valid."""
    try:
        action()
    except OSError as error:
        warnings.warn(f"CheckpointManager could not {what}: {error}", RuntimeWarning, stacklevel=3)
