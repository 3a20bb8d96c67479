"""A worker that ends after a peer failure ends within a bound, whatever its cleanup waits for.

Ending the interpreter the usual way (``sys.exit``, an uncaught `PeerFailureError`) first joins every
non-daemon thread, then runs the ``atexit`` handlers. After a peer failure either can wait on the
broken group: the checkpoint writer thread may be blocked in a save's collective that a *surviving*
peer will never finish, while that peer waits on this process (replica 0 of a plain ``python
train.py`` waits at exit for the replicas it started, and keeps its connections open meanwhile). Two
survivors then wait on each other until the collective's timeout (minutes) instead of ending.

So once a process is ending because a peer failed, a daemon thread gives its cleanup
`EXIT_SECONDS`, then says what was still running and ends the process with
`PEER_FAILURE_EXIT_CODE` (daemon threads run on through the joins and the ``atexit`` handlers). A
process ending that way has already printed the failure. An interactive session (``python -i``) is
left running: its deadline starts only when its interpreter ends.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - registers its joins first, so ours run before them
import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Protocol

from meshfit._runtime import PEER_FAILURE_EXIT_CODE

__all__ = ["EXIT_SECONDS", "end_within", "extend_deadline", "interpreter_exiting", "on_interpreter_exit", "tell_at_exit"]

EXIT_SECONDS = 10.0  # cleanup after a peer failure; the heartbeat's stop takes ~5 s of it at most (6 s timeout)

_lock = threading.Lock()
_armed_in: int | None = None  # the pid whose deadline thread runs (a forked child starts none of its own)
_deadline = 0.0  # when that thread ends the process (time.monotonic)
_exiting_in: int | None = None  # the pid whose interpreter began to end


def end_within(seconds: float, who: str) -> None:
    """End this process with `PEER_FAILURE_EXIT_CODE` if it is still running ``seconds`` from now.

    Called once this process is ending after a peer failure (``who`` names this worker in the
    message). The first call in a process arms the deadline; later calls change nothing.
    """
    global _armed_in, _deadline
    with _lock:
        if _armed_in == os.getpid():
            return
        _armed_in, _deadline = os.getpid(), time.monotonic() + seconds
    started = time.monotonic()

    def expire() -> None:
        while (left := _deadline - time.monotonic()) > 0:
            time.sleep(left)
        waiting = sorted(t.name for t in threading.enumerate()
                         if not t.daemon and t is not threading.main_thread() and t.is_alive())
        held = f" (threads still running: {', '.join(waiting)})" if waiting else ""
        with contextlib.suppress(Exception):
            print(f"meshfit: {who} was still ending {time.monotonic() - started:.0f} s after a peer failed{held}: "
                  "its cleanup is blocked, most likely in a collective of the failed group. Ending it now (exit "
                  f"code {PEER_FAILURE_EXIT_CODE}).", file=sys.stderr, flush=True)
        os._exit(PEER_FAILURE_EXIT_CODE)

    threading.Thread(target=expire, daemon=True, name="meshfit-exit-deadline").start()


def extend_deadline(seconds: float) -> bool:
    """Give this process at least ``seconds`` more before its deadline (one that waits for processes
    that are bounded themselves: replica 0 for the replicas it started); whether one is armed."""
    global _deadline
    with _lock:
        if _armed_in != os.getpid():
            return False
        _deadline = max(_deadline, time.monotonic() + seconds)
        return True


def interpreter_exiting() -> bool:
    """Whether this process's interpreter has begun to end (see `on_interpreter_exit`)."""
    return _exiting_in == os.getpid()


def on_interpreter_exit(callback: Callable[[], None]) -> None:
    """Call ``callback`` when the interpreter begins to end: before it joins the non-daemon threads
    (the checkpoint writer among them), where ``atexit`` handlers would run only after those joins."""
    def call() -> None:
        global _exiting_in
        _exiting_in = os.getpid()
        callback()

    register = getattr(threading, "_register_atexit", None)  # what concurrent.futures joins its threads with
    try:
        if register is not None:
            register(call)
        else:  # pragma: no cover - every supported Python has it; atexit runs after the joins
            atexit.register(call)
    except RuntimeError:  # the interpreter is already ending
        call()


class Ending(Protocol):
    """What `tell_at_exit` tells (a `Heartbeat`: it arms the deadline when it knows of a failure)."""

    def ending(self) -> None: ...


_told: weakref.WeakSet[Ending] = weakref.WeakSet()
_telling_in: int | None = None  # the pid that registered `_tell`


def _tell() -> None:
    for listener in list(_told):
        listener.ending()


def tell_at_exit(listener: Ending) -> None:
    """Call ``listener.ending()`` when this interpreter begins to end (`on_interpreter_exit`), if it lives."""
    global _telling_in
    _told.add(listener)
    if _telling_in != os.getpid():
        _telling_in = os.getpid()
        on_interpreter_exit(_tell)
