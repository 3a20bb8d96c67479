"""`BoundedStore`: a rendezvous-store connection whose requests cannot block for ever (the heartbeat's)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class BoundedStore:
    """A store connection whose every request returns within ``seconds`` or raises `TimeoutError`.

    torch's store clients bound only waits for keys: a request to a frozen server blocks forever. Here
    requests run on a daemon thread of their own; a caller that times out abandons that thread and
    the connection (the caller opens a fresh `BoundedStore`, so a late answer never reaches it).
    """

    def __init__(self, connect: Callable[[], Any], seconds: float) -> None:
        self._connect, self._seconds = connect, seconds
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name="meshfit-heartbeat-store")
        self._thread.start()

    def close(self) -> None:
        """End the thread (and drop its connection) after the requests already queued."""
        self.closed = True
        self._jobs.put(None)

    def join(self, seconds: float) -> None:
        self._thread.join(seconds)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _serve(self) -> None:
        store = None
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, box, done = item
            try:
                if store is None:
                    store = self._connect()
                box.append((True, job(store)))
            except BaseException as error:  # handed to the caller, which decides
                box.append((False, error))
            done.set()

    def call(self, job: Callable[[Any], Any], seconds: float | None = None) -> Any:
        """``job(store)``'s result within the bound (``seconds``, at most this store's own);
        raises what it raised, or `TimeoutError`."""
        bound = self._seconds if seconds is None else min(seconds, self._seconds)
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        self._jobs.put((job, box, done))
        if not done.wait(bound):
            raise TimeoutError(f"no answer within {bound:.3g} s")
        ok, value = box[0]
        if ok:
            return value
        raise value
