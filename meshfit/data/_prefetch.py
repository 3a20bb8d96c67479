"""A bounded background producer: computes items ``start, start+1, ...`` ahead of the consumer."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

_DONE = object()


class _Failed:
    """An item whose computation raised ``error`` (an element may itself be an exception object)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher:
    """Produce ``produce(k)`` for ``k = start, start + 1, ...`` on a daemon thread, ``size`` ahead.

    At most ``size`` items are computed and not yet taken (as ``tf.data``'s prefetch buffer): the
    thread waits for a free slot before it computes the next one. ``produce`` raises
    ``StopIteration`` at the end. An error computing item ``k`` is re-raised by the ``get`` that would
    have returned it, and production goes on with ``k + 1`` (as ``tf.data`` does). The consumer's
    position is all the state there is, so a stopped prefetcher loses nothing.
    """

    def __init__(self, produce: Callable[[int], Any], start: int, size: int) -> None:
        self._produce = produce
        self._queue: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(max(1, size))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(start,), daemon=True,
                                        name="meshfit-prefetch")
        self._thread.start()

    def _wait_for_slot(self) -> bool:
        while not self._stop.is_set():
            if self._slots.acquire(timeout=0.1):
                return True
        return False

    def _run(self, k: int) -> None:
        while self._wait_for_slot():
            try:
                item = self._produce(k)
            except StopIteration:
                self._queue.put(_DONE)
                return
            except Exception as error:  # item k failed: handed to the consumer, then on with k + 1
                item = _Failed(error)
            except BaseException as error:  # KeyboardInterrupt, SystemExit: the producer stops
                self._queue.put(_Failed(error))
                return
            self._queue.put(item)
            k += 1

    def get(self) -> Any:
        """The next item; raises ``StopIteration`` at the end, or the error computing this item."""
        item = self._queue.get()
        if item is _DONE:
            self._queue.put(_DONE)
            raise StopIteration
        if isinstance(item, _Failed) and not isinstance(item.error, Exception):
            self._queue.put(item)  # a stopped producer: every later get raises it too
            raise item.error
        self._slots.release()
        if isinstance(item, _Failed):
            raise item.error
        return item

    def close(self) -> None:
        """Stop the thread and drop what it had made."""
        self._stop.set()
        self._thread.join(timeout=60)  # never left running into interpreter shutdown inside a torch op
