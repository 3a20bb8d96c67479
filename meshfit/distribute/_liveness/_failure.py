"""`FailureState`: what the failure handling of a worker knows, in one typed object.

Written by the training loop (the step it is at), by the checkpoint saver (where the last backup
is), by a `CheckpointManager` (a custom loop's checkpoints) and by the preemption handler (this
worker is being stopped); read by the heartbeat and by the code that turns a broken collective into
an error naming the dead peer.
"""

from __future__ import annotations

import dataclasses
import weakref

from meshfit._protocols import CheckpointRecordLike


@dataclasses.dataclass
class FailureState:
    """Mutable facts about this worker that failure messages and decisions need.

    Attributes:
        step: the optimizer steps this worker has completed (``None`` before training).
        backup_dir: where the newest backup of this job is written, if any.
        terminating: this worker got SIGTERM (the launcher is stopping the group): a collective that
            breaks now ends it at once instead of waiting for the heartbeat to name a peer.
    """

    step: int | None = None
    backup_dir: str | None = None
    terminating: bool = False
    # The newest `CheckpointManager` of this job, held weakly (a message never keeps a model alive).
    _checkpoints: weakref.ReferenceType[CheckpointRecordLike] | None = dataclasses.field(
        default=None, repr=False, compare=False)

    def register_checkpoints(self, record: CheckpointRecordLike) -> None:
        """Name ``record``'s folder, latest checkpoint and step in failure messages (the newest one wins)."""
        self._checkpoints = weakref.ref(record)

    def _record(self) -> CheckpointRecordLike | None:
        return self._checkpoints() if self._checkpoints is not None else None

    def current_step(self) -> int | None:
        """The step this worker is at: the training loop's, else its checkpoint manager's step counter."""
        if self.step is not None:
            return self.step
        record = self._record()
        return record.current_step if record is not None else None

    def where_to_resume(self) -> str:
        """The sentence failure messages end with."""
        if self.backup_dir:
            return f"The last backup is in {self.backup_dir!r}; restart the job to resume from it."
        record = self._record()
        if record is not None:
            latest = record.latest_checkpoint
            saved = (f"its latest checkpoint is {latest!r}" if latest is not None
                     else "it has saved no checkpoint yet")
            return (f"This job's CheckpointManager writes to {record.directory!r} and {saved}; restart the job "
                    "and call manager.restore_or_initialize() to resume from it.")
        return "No backup was configured (add mf.callbacks.BackupAndRestore to resume)."
