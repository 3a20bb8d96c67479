"""`SaveFuture`: the handle of a checkpoint being written in the background."""

from __future__ import annotations

from concurrent.futures import Future


class SaveFuture:
    """Completes when an async ``Checkpoint.save`` / ``CheckpointManager.save`` is final on every rank.

    "Final" means the directory has been renamed to its path (it is then a complete checkpoint and
    ``latest_checkpoint`` can return it). Every rank must wait on its own future (or start another
    save or restore, which waits) before destroying its process group or exiting.

    Attributes:
        path: the absolute path of the checkpoint being written.
    """

    def __init__(self, path: str, future: Future) -> None:
        self.path = path
        self._future = future

    def result(self, timeout: float | None = None) -> str:
        """Wait for the save and return its path.

        Args:
            timeout: seconds to wait; None waits until done.

        Returns:
            The checkpoint path.

        Raises:
            TimeoutError: not done within ``timeout``.
            Exception: whatever made the save fail (its ``.tmp`` directory is removed; the previous
                checkpoint is untouched and stays the latest).
        """
        return self._future.result(timeout)

    def wait(self, timeout: float | None = None) -> str:
        """Same as :meth:`result`."""
        return self.result(timeout)

    def done(self) -> bool:
        """True once the save has finished, successfully or not."""
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the save; return its error, or None if it succeeded."""
        return self._future.exception(timeout)

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self.exception() else "done")
        return f"SaveFuture(path={self.path!r}, {state})"
