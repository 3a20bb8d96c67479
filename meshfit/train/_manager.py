"""`CheckpointManager` and `latest_checkpoint`: numbered checkpoints in a directory, pruned."""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any, Literal, overload

from meshfit._storage import atomic_write_json, remove_tree
from meshfit._validation import is_int
from meshfit.distribute import current_world, process_world
from meshfit.train import _storage
from meshfit.train._backup import restore_newest_intact
from meshfit.train._checkpoint import Checkpoint, _wait_for_pending_save
from meshfit.train._counters import live_step, step_value
from meshfit.train._retention import STATE_FILE_NAME, Retention, read_state
from meshfit.train._save_future import SaveFuture


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
    """Saves numbered checkpoints ``<directory>/<checkpoint_name>-N`` and keeps the newest few, as
    ``tf.train.CheckpointManager``.

    The truth is the set of complete checkpoint directories on disk: a manager created after a
    crash finds them (partial ones are ignored) and continues numbering after the largest ``N``.
    After each save, rank 0 also writes ``<directory>/checkpoint`` (JSON, atomically): the managed
    checkpoints with their save times and the preserved ones (see ``meshfit/train/_retention.py``)::

        {"latest_checkpoint": "ckpt-7", "all_checkpoints": ["ckpt-5", "ckpt-6", "ckpt-7"], ...}

    A new manager's :attr:`latest_checkpoint` is ``latest_checkpoint(directory)``: the newest complete
    checkpoint in the folder whatever its name (as TF, where both read the folder's one state file), so
    ``checkpoint.restore(manager.latest_checkpoint)`` restores what a ``Checkpoint.save`` under another
    name wrote there; :attr:`checkpoints` lists only this manager's own ``<checkpoint_name>-N``.

    Every rank must create the manager and call ``save`` / ``restore_or_initialize`` together.

    Args:
        checkpoint: the :class:`Checkpoint` to save.
        directory: where checkpoints go (created on first save).
        max_to_keep: how many managed checkpoints to keep; older ones are deleted by rank 0 after
            each save (never the one just written), unless preserved. None keeps all.
        keep_checkpoint_every_n_hours: a checkpoint leaving the managed list is preserved (kept on disk
            for good) if at least this many hours passed since the last preserved one. None: none is.
        checkpoint_name: the directory name prefix.
        step_counter: optional; when given and ``save`` gets no ``checkpoint_number``, checkpoints
            are numbered with its current value: an int, a NumPy integer, a 0-d integer tensor, or a
            zero-argument callable returning one. Required by ``checkpoint_interval``.
        checkpoint_interval: the fewest steps (of ``step_counter``) between two checkpoints: a
            ``save(check_interval=True)`` sooner returns None without saving. None: no interval.
        init_fn: called by :meth:`restore_or_initialize` when there is no checkpoint to restore
            (e.g. to load pretrained weights).
        last_checkpoint_step: the step the interval counts from (None: the first save is due).

    Raises:
        TypeError: ``checkpoint`` is not a ``Checkpoint``, or ``init_fn`` is not callable.
        ValueError: another argument is invalid (``checkpoint_interval`` without ``step_counter``...).

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
                 keep_checkpoint_every_n_hours: float | None = None, checkpoint_name: str = "ckpt",
                 step_counter: Any = None, checkpoint_interval: int | None = None,
                 init_fn: Callable[[], Any] | None = None, last_checkpoint_step: Any = None) -> None:
        _check_arguments(checkpoint, max_to_keep, keep_checkpoint_every_n_hours, checkpoint_name,
                         step_counter, checkpoint_interval, init_fn)
        self._checkpoint = checkpoint
        self._directory = os.path.abspath(os.fspath(directory))
        self._max_to_keep = max_to_keep
        self._name = checkpoint_name
        self._step_counter = step_counter
        self._checkpoint_interval = checkpoint_interval
        self._init_fn = init_fn
        self._last_checkpoint_step = (None if last_checkpoint_step is None
                                      else step_value(last_checkpoint_step, "last_checkpoint_step"))
        self._seen_step: int | None = None  # the step counter's value when last read
        self._lock = threading.Lock()
        self._retention = Retention(max_to_keep, keep_checkpoint_every_n_hours)
        self._latest, self._next_number = self._recover()
        self._register_for_failure_messages()

    def _recover(self) -> tuple[str | None, int]:
        """Take over the folder: its managed checkpoints, the newest checkpoint, the next number."""
        _wait_for_pending_save()  # an async save still in flight (an interrupted fit's) lands before the scan
        everything = _storage.complete_checkpoints(self._directory)
        own = [p for p in everything if _storage.checkpoint_number(os.path.basename(p), self._name) is not None]
        own.sort(key=lambda p: _storage.checkpoint_number(os.path.basename(p), self._name) or 0)
        self._retention.recover(own, read_state(self._directory))
        numbers = [_storage.checkpoint_number(os.path.basename(p), self._name) or 0 for p in own]
        return (everything[-1] if everything else None), max(numbers, default=0) + 1

    def _register_for_failure_messages(self) -> None:
        """A peer failure's message names this manager's folder, latest checkpoint and step (a custom loop
        has no `BackupAndRestore` to name)."""
        world = self._checkpoint.world if self._checkpoint.world is not None else process_world()
        if world is not None:
            world.failure.register_checkpoints(self)

    @property
    def directory(self) -> str:
        """The absolute checkpoint directory."""
        return self._directory

    @property
    def checkpoint(self) -> Checkpoint:
        """The managed :class:`Checkpoint`."""
        return self._checkpoint

    @property
    def checkpoint_interval(self) -> int | None:
        """The fewest steps between two checkpoints, or None."""
        return self._checkpoint_interval

    @property
    def checkpoints(self) -> list[str]:
        """This manager's managed checkpoint paths, oldest first (preserved ones are not listed; an async
        save appears once it is complete)."""
        with self._lock:
            return list(self._retention.managed)

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest checkpoint path: the last one this manager saved, else the newest complete one the
        folder held when the manager was made (whatever its name); None if there is none."""
        with self._lock:
            return self._latest

    @property
    def current_step(self) -> int | None:
        """The step counter's value as last read (live for an int or CPU tensor), or None without one."""
        live = live_step(self._step_counter)
        return live if live is not None else self._seen_step

    @overload
    def save(self, checkpoint_number: Any = None, check_interval: bool = True,
             async_save: Literal[False] = False) -> str | None: ...

    @overload
    def save(self, checkpoint_number: Any = None, check_interval: bool = True, *,
             async_save: Literal[True]) -> SaveFuture | None: ...

    def save(self, checkpoint_number: Any = None, check_interval: bool = True,
             async_save: bool = False) -> str | SaveFuture | None:
        """Save ``<directory>/<checkpoint_name>-N`` (collective), then prune and update the state file.

        A complete checkpoint's identity is immutable: ``<checkpoint_name>-N`` always holds what the
        save numbered ``N`` wrote, so a number that already names a complete checkpoint is refused
        rather than overwritten (a kill during an overwrite could otherwise leave ``ckpt-1`` holding
        a newer step than the save that was acknowledged as ``ckpt-1``).

        Args:
            checkpoint_number: ``N``: an int, a NumPy integer or a 0-d integer tensor; by default the
                step counter's value if there is one, else one more than the largest ``N`` saved or found.
            check_interval: with a ``checkpoint_interval``, save only if that many steps passed since the
                last checkpoint; with False, save unless one was saved at this step already. Without a
                ``checkpoint_interval`` it has no effect.
            async_save: write in the background (see :meth:`Checkpoint.save`); the new checkpoint
                joins :attr:`checkpoints` and pruning happens when the write completes.

        Returns:
            The path written, or a :class:`SaveFuture` resolving to it; None when the interval says
            no checkpoint is due.

        Raises:
            ValueError: ``checkpoint_number`` (or the step counter) is not a non-negative integer.
            FileExistsError: ``<checkpoint_name>-N`` is already a complete checkpoint.
        """
        _wait_for_pending_save()  # an async save in flight completes (and is recorded) first
        needs_step = self._checkpoint_interval is not None or checkpoint_number is None
        step = self._read_step_counter() if self._step_counter is not None and needs_step else None
        if not self._is_due(step, check_interval):
            return None
        number = self._number(checkpoint_number, step)
        path = os.path.join(self._directory, f"{self._name}-{number}")
        self._refuse_existing(path, number, checkpoint_number)
        self._next_number = max(self._next_number, number + 1)
        return self._checkpoint.save(path, async_save=async_save, on_commit=self._record)

    def restore_or_initialize(self) -> str | None:
        """Restore :attr:`latest_checkpoint` if there is one (collective), else call ``init_fn`` if given.

        A checkpoint that fails verification (a data file's checksum, an unreadable state file) is
        skipped with a warning naming it and why, and the newest one that verifies is restored.

        Returns:
            The restored path, or None when there is nothing to restore (the objects keep their
            freshly initialised state, or what ``init_fn`` gave them).

        Raises:
            CorruptFileError: every checkpoint failed verification (the message names the newest).
        """
        _wait_for_pending_save()
        latest = self.latest_checkpoint
        if latest is None:
            if self._init_fn is not None:
                self._init_fn()
            return None
        candidates = [p for p in self.checkpoints if p != latest] + [latest]
        restored = restore_newest_intact(self._checkpoint, candidates, is_chief=self._rank() == 0)
        if restored is None:
            self._checkpoint.restore(latest)  # raises the newest one's error
        if self._checkpoint_interval is not None:
            self._last_checkpoint_step = self._read_step_counter()
        return restored

    def __repr__(self) -> str:
        return (f"CheckpointManager(directory={self._directory!r}, max_to_keep={self._max_to_keep}, "
                f"checkpoint_name={self._name!r}, latest={self.latest_checkpoint!r})")

    def _read_step_counter(self) -> int:
        self._seen_step = step_value(self._step_counter, "step_counter")
        return self._seen_step

    def _is_due(self, current: int | None, check_interval: bool) -> bool:
        """TF's interval rule at step ``current``: never twice at one step; with ``check_interval``, not
        before ``checkpoint_interval`` steps passed. A due save records its step at once (as TF)."""
        if self._checkpoint_interval is None or current is None:
            return True
        last = self._last_checkpoint_step
        if last is not None:
            if current == last or (check_interval and current < last + self._checkpoint_interval):
                return False
        self._last_checkpoint_step = current
        return True

    def _number(self, checkpoint_number: Any, step: int | None) -> int:
        """The ``N`` for the next save: the one given, else the step counter's value, else the next free one."""
        if checkpoint_number is not None:
            return step_value(checkpoint_number, "checkpoint_number")
        return step if step is not None else self._next_number

    def _refuse_existing(self, path: str, number: int, checkpoint_number: Any) -> None:
        if not _storage.is_complete(path):
            return
        source = "checkpoint_number" if checkpoint_number is not None or self._step_counter is None \
            else "step_counter"
        raise FileExistsError(
            f"Invalid `{source}`: {path!r} is already a complete checkpoint (number {number}). A "
            "checkpoint's content never changes once it is complete, so its number is not reused. Save "
            f"under a new number (save() with no number uses {max(self._next_number, number + 1)}), or "
            "remove that checkpoint first if it is really meant to be replaced.")

    def _rank(self) -> int:
        """This process's rank in the job the checkpoint saves in (its `World`)."""
        world = self._checkpoint.world
        return (world if world is not None else current_world()).rank

    def _record(self, path: str, own_copy: bool = False) -> None:
        """After ``path`` is complete on every rank: remember it, prune, write the state file (rank 0,
        or every rank when each saved its own copy to its own directory)."""
        rank = self._rank()
        with self._lock:
            doomed = self._retention.add(path)
            self._latest = path
            state = self._retention.state(path)
        if rank != 0 and not own_copy:
            return
        for old in doomed:
            # In the foreground: a checkpoint is a few files (one per writing rank), so unlinking them
            # is cheap, and a caller listing the folder after save() returns sees only kept checkpoints.
            _best_effort(functools.partial(remove_tree, old),
                         f"delete old checkpoint {old!r}")
        _best_effort(lambda: atomic_write_json(os.path.join(self._directory, STATE_FILE_NAME), state),
                     f"write {os.path.join(self._directory, STATE_FILE_NAME)!r}")


def _check_arguments(checkpoint: Any, max_to_keep: Any, keep_hours: Any, checkpoint_name: Any,
                     step_counter: Any, checkpoint_interval: Any, init_fn: Any) -> None:
    """Refuse bad constructor arguments in Keras's house format."""
    if not isinstance(checkpoint, Checkpoint):
        raise TypeError(f"Invalid `checkpoint`: expected a meshfit.train.Checkpoint, received "
                        f"{type(checkpoint).__name__}. Build one with Checkpoint(model=..., optimizer=...).")
    if max_to_keep is not None and (not is_int(max_to_keep) or max_to_keep < 1):
        raise ValueError(f"Invalid `max_to_keep`: expected a positive int or None, received "
                         f"max_to_keep={max_to_keep!r}.")
    if keep_hours is not None and (isinstance(keep_hours, bool) or not isinstance(keep_hours, int | float)
                                   or not keep_hours > 0):
        raise ValueError(f"Invalid `keep_checkpoint_every_n_hours`: expected a positive number of hours or None, "
                         f"received keep_checkpoint_every_n_hours={keep_hours!r}.")
    if (not isinstance(checkpoint_name, str) or not checkpoint_name or "/" in checkpoint_name
            or os.sep in checkpoint_name):
        raise ValueError(f"Invalid `checkpoint_name`: expected a non-empty name without path "
                         f"separators, received checkpoint_name={checkpoint_name!r}.")
    if checkpoint_interval is not None:
        if not is_int(checkpoint_interval) or checkpoint_interval < 1:
            raise ValueError(f"Invalid `checkpoint_interval`: expected a positive int (steps) or None, received "
                             f"checkpoint_interval={checkpoint_interval!r}.")
        if step_counter is None:
            raise ValueError(f"Invalid `step_counter`: `step_counter` should be passed if `checkpoint_interval` "
                             f"is not None, received step_counter=None with checkpoint_interval="
                             f"{checkpoint_interval}. Pass the step variable, e.g. step_counter=step.")
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"Invalid `init_fn`: expected a callable taking no arguments or None, received "
                        f"init_fn={init_fn!r}.")


def _best_effort(action: Callable[[], None], what: str) -> None:
    """Housekeeping after a complete save: a failure is reported, the new checkpoint stays valid."""
    try:
        action()
    except OSError as error:
        warnings.warn(f"CheckpointManager could not {what}: {error}", RuntimeWarning, stacklevel=3)
