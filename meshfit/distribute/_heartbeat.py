"""Dead-peer detection: every worker beats through the rendezvous store; silence means death.

Each process bumps a counter under ``meshfit/hb/<rank>`` every ``interval`` seconds from a daemon
thread (so a long step does not look like death), and watches the others' counters. A peer whose
counter has not moved for ``timeout`` seconds, or a store that stopped answering (its host, rank 0,
is gone), is a dead peer. The training loop sees it at the next step boundary and raises
`PeerFailureError`; if the main thread is stuck inside a collective instead, the watchdog prints the
same message and ends the process with `PEER_FAILURE_EXIT_CODE` so that nothing ever hangs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from meshfit._exit_codes import PEER_FAILURE_EXIT_CODE
from meshfit.distribute._failure import FailureState

__all__ = ["PEER_FAILURE_EXIT_CODE", "Heartbeat", "PeerFailureError"]

_GRACE_SECONDS = 3.0


class PeerFailureError(RuntimeError):
    """A worker of the group stopped (killed, crashed or unreachable)."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class Heartbeat:
    """Publishes this rank's heartbeat and watches the others' (see the module docstring)."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout: float,
                 failure_state: FailureState, interval: float | None = None) -> None:
        self._store, self._rank, self._world = store, rank, world_size
        self._timeout = float(timeout)
        self._interval = interval or max(0.2, min(1.0, self._timeout / 5))
        self._state = failure_state
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.failure: PeerFailureError | None = None
        self.handled = False
        self._watching = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="meshfit-heartbeat")
        self._thread.start()

    def _beat(self, count: int) -> None:
        step = "?" if self._state.step is None else self._state.step
        self._store.set(f"meshfit/hb/{self._rank}", f"{count}:{step}")

    def _run(self) -> None:
        count = 0
        seen: dict[int, tuple[bytes, float]] = {}
        started = time.monotonic()
        while not self._stop.wait(self._interval):
            count += 1
            now = time.monotonic()
            try:
                self._beat(count)
                for peer in range(self._world):
                    if peer == self._rank:
                        continue
                    key = f"meshfit/hb/{peer}"
                    value = self._store.get(key) if self._store.check([key]) else b""
                    last = seen.get(peer)
                    if last is None or last[0] != value:
                        seen[peer] = (value, now)
                    elif not self._watching:
                        seen[peer] = (value, now)
                    elif now - last[1] > self._timeout and now - started > self._timeout:
                        self._declare(peer, value, f"sent no heartbeat for {now - last[1]:.1f}s")
                        return
            except Exception as error:  # the store is hosted by rank 0: it is unreachable
                if self._stop.is_set() or not self._watching:
                    continue
                self._declare(0, b"", f"its rendezvous store stopped answering ({type(error).__name__})")
                return

    def _declare(self, peer: int, value: bytes, why: str) -> None:
        last_step = value.decode(errors="replace").partition(":")[2] or "?"
        where = self._state.where_to_resume()
        step = "?" if self._state.step is None else self._state.step
        message = (f"Worker {peer} stopped: {why} (its last reported step: {last_step}; this worker, rank "
                   f"{self._rank}, is at step {step}). {where}")
        with self._lock:
            self.failure = PeerFailureError(message, rank=peer)
        if self._stop.wait(_GRACE_SECONDS) or self.handled:
            return
        # The main thread did not pick the failure up: it is blocked in a collective. Never hang.
        print(f"meshfit: {message}", file=sys.stderr, flush=True)
        os._exit(PEER_FAILURE_EXIT_CODE)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Declare silent peers dead only inside this region (training, evaluation, saving).

        Outside it, peers may legitimately be gone (a worker that finished and exited, taking the
        store with it when it is rank 0).
        """
        self._watching += 1
        try:
            yield
        finally:
            self._watching -= 1

    def check(self) -> None:
        """Raise the peer failure, if one was detected."""
        with self._lock:
            failure = self.failure
        if failure is not None:
            self.handled = True
            raise failure

    def wait_for_failure(self, seconds: float) -> PeerFailureError | None:
        """After a collective broke, give the watchdog up to ``seconds`` to name the dead peer."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with self._lock:
                if self.failure is not None:
                    self.handled = True
                    return self.failure
            time.sleep(0.05)
        return None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
