"""`PreemptionWatch`: SIGTERM sets a flag that the loop shares with every replica at the next step."""

from __future__ import annotations

import signal
from typing import Any

from meshfit._protocols import FailureStateLike


class PreemptionWatch:
    """Turns SIGTERM into a request that every replica sees at the same step.

    Args:
        enabled: install the handler (a callback can save a backup on preemption).
        failure: this worker's failure state: a worker being stopped ends at once if a collective
            breaks, rather than waiting for the heartbeat to name a peer.
    """

    def __init__(self, enabled: bool, failure: FailureStateLike) -> None:
        self.requested = False
        self._failure = failure
        self._previous: Any = None
        if enabled:
            try:
                self._previous = signal.signal(signal.SIGTERM, self._on_signal)
            except ValueError:  # not the main thread: leave SIGTERM alone
                self._previous = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True
        self._failure.terminating = True

    def close(self) -> None:
        """Restore the previous SIGTERM handler."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
