"""`FailureState`: what the failure handling of a worker knows, in one typed object.

Written by the training loop (the step it is at), by the checkpoint saver (where the last backup
is) and by the preemption handler (this worker is being stopped); read by the heartbeat and by
the code that turns a broken collective into an error naming the dead peer.
"""

from __future__ import annotations

import dataclasses


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

    def where_to_resume(self) -> str:
        """The sentence failure messages end with."""
        if self.backup_dir:
            return f"The last backup is in {self.backup_dir!r}; restart the job to resume from it."
        return "No backup was configured (add mf.callbacks.BackupAndRestore to resume)."
