"""`CheckpointSaver`: saves *all* training state by a `SavePolicy`; a new run continues where it stopped.

The general saver behind `BackupAndRestore` and the Estimator's ``model_dir`` checkpoints. What it
saves is the training loop's ``checkpoint_items()``: the trainable's parts (module weights,
optimizer), the loop's counters, data position and callback state, and each replica's own RNG
streams and metric accumulators. A backup is taken after every other callback has run for that
step or epoch (this callback always runs last).

Checkpoints are `meshfit.train.CheckpointManager` checkpoints (atomic; the newest ``max_to_keep``
kept, so a crash during a save leaves the previous one usable)::

    directory/
      meshfit_backup.json   with delete_on_end: marks a folder meshfit may clean (a non-empty one
                            without it is refused)
      checkpoint        {"latest_checkpoint": "ckpt-12", ...}
      ckpt-11/          the previous complete checkpoint
      ckpt-12/          the newest complete checkpoint
      ckpt-13.tmp/      a save in progress (ignored until renamed; see meshfit/_storage/_atomic.py)

When ``fit`` starts (before any callback's ``on_train_begin``: `restore_training`, called by the
loop) the newest checkpoint that verifies is restored: a corrupt one (a data file's CRC-32C, an
unreadable state file) is skipped with a warning naming it, and the previous one is used.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING, Any, Protocol

from meshfit._storage import StateMismatchError, chief_writes
from meshfit._validation import check_bool, finite_float, optional_positive_int, path_like, positive_int
from meshfit.callbacks._callback import Callback
from meshfit.distribute import ReplicaDivergenceError

if TYPE_CHECKING:
    from meshfit._protocols import LoopLike


class SaveGuard(Protocol):
    """Checks the replicas before a save (`VerifyReplicas`) and handles a divergence found by one."""

    def before_save(self) -> bool:
        """Run a check due at this step; False when the state was rolled back (nothing to save)."""
        ...

    def diverged(self, error: ReplicaDivergenceError) -> None:
        """Act on replicas found to differ while saving: raise, or roll every worker back."""
        ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class SavePolicy:
    """When a `CheckpointSaver` saves.

    Args:
        every_steps: save when the optimizer step count reaches a multiple of this (with several
            steps per execution: at the end of the execution that crosses it).
        every_seconds: save at the first step at least this long after the previous save (the
            replicas agree on the step, so a collective save never splits).
        every_epoch: save at each epoch's end.
        on_preemption: on SIGTERM, every replica saves at the same step and exits with code 75.

    Example:
        >>> SavePolicy(every_steps=30)
        SavePolicy(every_steps=30, every_seconds=None, every_epoch=False, on_preemption=True)
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    every_epoch: bool = False
    on_preemption: bool = True

    def __post_init__(self) -> None:
        optional_positive_int("every_steps", self.every_steps)
        if self.every_seconds is not None:
            finite_float("every_seconds", self.every_seconds, positive=True)
        check_bool("every_epoch", self.every_epoch)
        check_bool("on_preemption", self.on_preemption)


class CheckpointSaver(Callback):
    """Saves training state to ``directory`` by ``policy`` and restores the newest at ``fit`` start.

    Args:
        directory: where checkpoints go; all workers must see it (one folder per job).
        policy: when to save (default: at each epoch's end, and on preemption).
        max_to_keep: how many complete checkpoints to keep.
        checkpoint_name: the checkpoint directories' name prefix (``<name>-N``).
        async_save: write in the background (DCP async save) so training does not wait.
        delete_on_end: delete the checkpoints when training completes.

    Example:
        >>> saver = CheckpointSaver("/tmp/run", policy=SavePolicy(every_steps=100), max_to_keep=3)
        >>> saver.policy.every_steps
        100
    """

    run_last = True  # save only once every other callback has finished the step or epoch
    directory_argument = "directory"  # the folder's argument name, for messages
    reads_batch_logs = False
    stops_in_batch_hooks = False  # its batch hook saves (a collective of its own, at agreed steps) and never stops

    def __init__(self, directory: str | os.PathLike, policy: SavePolicy | None = None, max_to_keep: int = 2,
                 checkpoint_name: str = "ckpt", async_save: bool = False, delete_on_end: bool = False) -> None:
        super().__init__()
        self.directory = os.path.abspath(path_like("directory", directory))
        if policy is None:
            policy = SavePolicy(every_epoch=True)
        if not isinstance(policy, SavePolicy):
            raise TypeError(f"Invalid `policy`: expected a meshfit.callbacks.SavePolicy, received policy={policy!r}.")
        self.policy = policy
        self.max_to_keep = positive_int("max_to_keep", max_to_keep)
        self.checkpoint_name = checkpoint_name
        self.async_save = check_bool("async_save", async_save)
        self.delete_on_end = check_bool("delete_on_end", delete_on_end)
        self.restored_from: str | None = None
        self.manager: Any = None  # the CheckpointManager of `directory`, made when training begins
        self._pending: Any = None
        self._saved_at: int | None = None
        self._checked_at = 0  # the step count at the previous batch end
        self._last_save_time = time.monotonic()
        self.guard: SaveGuard | None = None  # set by a VerifyReplicas in the same fit
        self._prepared_for: LoopLike | None = None  # the loop this saver last prepared (restore_training)

    def agreed_settings(self) -> dict[str, Any]:
        """The arguments every worker must pass alike, by the user's argument names (compared by ``fit``)."""
        return {"policy": self.policy, "async_save": self.async_save, "max_to_keep": self.max_to_keep,
                "checkpoint_name": self.checkpoint_name, "delete_on_end": self.delete_on_end}

    @property
    def handles_preemption(self) -> bool:
        return self.policy.on_preemption

    def make_manager(self, checkpoint: Any) -> Any:
        """The `CheckpointManager` of this saver's folder (a subclass may name checkpoints otherwise)."""
        from meshfit.train import CheckpointManager  # lazily loaded public subpackage

        return CheckpointManager(checkpoint, self.directory, max_to_keep=self.max_to_keep,
                                 checkpoint_name=self.checkpoint_name)

    # ---- RestoresTraining: the loop calls this before any callback hook --------------------------
    def restore_training(self, loop: LoopLike) -> bool:
        """Claim the folder, make this run's manager, and restore the newest intact checkpoint into the
        loop (collective). `TrainingLoop.run` calls it before any ``on_train_begin``.

        Returns:
            Whether a checkpoint was restored.
        """
        self.prepare(loop)
        strategy = loop.strategy
        try:
            latest = loop.resume(strategy.broadcast_object(self.manager.checkpoints))
        except StateMismatchError as error:  # the folder holds another run's state: say so, and the fix
            raise StateMismatchError(
                f"{type(self).__name__} cannot resume from {self.directory!r}: {error} That folder holds the "
                f"backup of a run with another model or other data. Give this run another "
                f"`{self.directory_argument}`, or delete {self.directory!r} to start over.") from error
        self.restored_from = latest
        self.reset_clock(saved=latest is not None)
        if latest is not None and strategy.is_chief:
            counters = loop.counters
            print(f"{type(self).__name__}: resuming from {latest} at epoch {counters.epoch + 1}, "
                  f"batch {counters.step + 1} (iteration {counters.iterations})", flush=True)
        return latest is not None

    def prepare(self, loop: LoopLike) -> None:
        """This run's side of the folder: refuse one holding files meshfit would not delete, make the
        manager over the loop's snapshot, name the folder in failure messages."""
        from meshfit.train import claim_backup_dir  # lazily loaded public subpackage

        strategy = loop.strategy
        if self.delete_on_end:  # refuse a folder holding files meshfit would not delete
            chief_writes(lambda: claim_backup_dir(self.directory, self.checkpoint_name),
                         is_chief=strategy.is_chief, gather=strategy.all_gather_object,
                         what=f"use {self.directory!r} as the checkpoint folder")
        self.manager = self.make_manager(loop.snapshot())
        self._prepared_for = loop
        self.restored_from = None
        strategy.failure.backup_dir = self.directory
        self.reset_clock()

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.loop is None or self._prepared_for is not self.loop:
            raise RuntimeError(f"{type(self).__name__} saves training state: use it in fit's callbacks (the "
                               "training loop restores through it before any callback hook).")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.directory_argument}={self.directory!r})"

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        policy, iterations = self.policy, self._require_loop().counters.iterations
        previous, self._checked_at = self._checked_at, iterations
        due = policy.every_steps is not None and iterations // policy.every_steps > previous // policy.every_steps
        if policy.every_seconds is not None:
            late = time.monotonic() - self._last_save_time >= policy.every_seconds
            due = self._require_loop().agree(late) or due
        if due:
            self.save()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.policy.every_epoch:
            self.save()

    def save_for_preemption(self) -> None:
        """Called by the loop when a worker got SIGTERM: every replica saves at the same step."""
        if self._saved_at != self._require_loop().counters.iterations:  # not already saved at this step
            self.save()
        self.wait()

    @property
    def saved_at(self) -> int | None:
        """The optimizer step of this saver's latest save (or of the checkpoint it resumed from)."""
        return self._saved_at

    def reset_clock(self, saved: bool = False) -> None:
        """Count the policy's steps and seconds from now; ``saved``: the current step is saved."""
        self._last_save_time = time.monotonic()
        self._checked_at = self._require_loop().counters.iterations
        if saved:
            self._saved_at = self._checked_at

    def on_train_end(self, logs: dict | None = None) -> None:
        self.wait()
        if self.delete_on_end:
            strategy = self._require_loop().strategy
            strategy.barrier()
            if strategy.is_chief:
                delete_checkpoints(self.directory, self.checkpoint_name)
            strategy.barrier()

    def save(self) -> None:
        """Save the loop's state now (collective; in the background with ``async_save``).

        Under a strategy the save records the state's digest once the replicas agreed on it; a
        save whose replicas differ is not committed (`ReplicaDivergenceError`, naming them), and
        with a `VerifyReplicas` in the callbacks, that callback decides (stop, or roll back).
        """
        self.wait()
        if self.guard is not None and not self.guard.before_save():
            return  # the replicas differed and every worker went back to the last backup
        loop = self._require_loop()
        loop.agree_buffers()  # one defined copy of running statistics is saved: rank 0's
        self._saved_at = loop.counters.iterations
        self._last_save_time = time.monotonic()
        try:
            if self.async_save:
                self._pending = self.manager.save(async_save=True)
            else:
                self.manager.save()
        except ReplicaDivergenceError as error:
            if self.guard is None:
                raise
            self.guard.diverged(error)

    def wait(self) -> None:
        """Wait for a background save in flight (its error is raised here)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()


def checkpoint_settings(callbacks: Any) -> dict[str, Any]:
    """The checkpoint callbacks' settings that must agree between workers, for ``agree_on_settings``:
    each callback's policy, and each of its arguments by name (``BackupAndRestore's async_save``), so
    that a mismatch names the argument to fix rather than failing later in a collective save."""
    savers = [c for c in callbacks if isinstance(c, CheckpointSaver)]
    settings: dict[str, Any] = {"checkpoint policies": [repr(c.policy) for c in savers]}
    for index, saver in enumerate(savers):
        owner = type(saver).__name__ + (f" #{index + 1}" if len(savers) > 1 else "")
        settings.update({f"{owner}'s {name}": value for name, value in saver.agreed_settings().items()})
    return settings


def delete_checkpoints(directory: str, checkpoint_name: str = "ckpt") -> None:
    """Remove a finished job's checkpoints: only what meshfit wrote (see ``meshfit/train/_backup.py``)."""
    from meshfit.train import delete_backup_dir  # lazily loaded public subpackage

    delete_backup_dir(directory, checkpoint_name)
