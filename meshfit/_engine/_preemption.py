"""`PreemptionWatch`: SIGTERM sets a flag that the loop shares with every replica at an agreed step;
`PreemptionChecks`: which steps share it where nothing else needs sharing inside an epoch."""

from __future__ import annotations

import signal
import time
from typing import Any

from meshfit._protocols import FailureStateLike

#: Where the preemption flag is the only thing the workers must share inside an epoch (a saver handles
#: preemption; no callback may stop training in a batch hook; the built-in ``train_step``), they share it
#: about this often, in seconds of training, rather than after every step: a SIGTERM is acted on within
#: about this long plus a step (a preemption notice gives tens of seconds), at one step on every worker.
CHECK_SECONDS = 0.25
_MAX_INTERVAL = 100_000  # steps between two checks, at most


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


class PreemptionChecks:
    """The steps at which the workers share the preemption flag when nothing else needs sharing.

    Every check is the loop's one reduction of its flags; it also carries the chief's proposal for the
    number of steps to the next check (`proposal`: about `CHECK_SECONDS` of steps at the pace since the
    previous check; the other processes add 0). The proposal is a whole number, so its sum is exact in
    any order: every process reads the same interval and checks at the same steps.
    """

    def __init__(self) -> None:
        self.next_at = 0  # the iteration count from which the next execution checks
        self._last: tuple[float, int] | None = None  # (monotonic time, iterations) at the previous check

    def due(self, iterations: int) -> bool:
        return iterations >= self.next_at

    def proposal(self, iterations: int, proposes: bool) -> float:
        """This process's term of the next interval: the chief's estimate, 0 elsewhere."""
        if not proposes:
            return 0.0
        if self._last is None or iterations <= self._last[1]:
            return 1.0
        seconds, steps = time.monotonic() - self._last[0], iterations - self._last[1]
        return float(max(1, min(_MAX_INTERVAL, int(CHECK_SECONDS * steps / seconds) if seconds > 0 else _MAX_INTERVAL)))

    def agreed(self, iterations: int, interval: float) -> None:
        """A check ran at ``iterations``; the next one comes ``interval`` (summed proposals) steps later."""
        self.next_at = iterations + max(1, int(interval))
        self._last = (time.monotonic(), iterations)
