"""Dead-peer detection: every worker beats through the rendezvous store; silence means death.

Each process publishes a beat every ``interval`` seconds from a daemon thread (so a long step does
not look like death) and watches the others'. A peer whose beats stop for ``timeout`` seconds is
dead, frozen or cut off; a store that stops answering for ``timeout`` seconds means its host, rank 0,
is (the store runs inside rank 0, so a frozen chief freezes it too). A peer's first beat may take
``_FIRST_BEAT_FACTOR`` times as long: a starting process competes for the cores with every other
worker's imports and first steps (on a loaded host its beat thread can wait seconds for the
interpreter lock), and a starting peer that is killed is still named at once by its liveness
connection, so only a peer frozen before its first beat is found later. The watchdog talks to the store
over its own connection, with its own short timeout, so neither a frozen store nor a rendezvous
blocked in another thread can block it.

Beats cannot be forged or replayed by someone who can reach the store: beat ``n`` of rank ``r`` is
the key ``meshfit/hb/<r>/<n>.<mac>``, where ``mac`` is an HMAC of ``r/n`` under a secret that rank 0
drew and sent to the others over the process group (never through the store); a watcher accepts only
keys it can recompute, and only increasing ``n``. ``meshfit/hb/<r>`` holds ``n`` as an unsigned hint.

Outside the main thread's reach the watchdog acts alone: the loop sees a failure at the next step
boundary (`Heartbeat.check`) or when a collective breaks (`Heartbeat.wait_for_failure`); if the main
thread has not picked it up ``_GRACE_SECONDS`` later (it is blocked in a collective), the watchdog
prints the message and ends the process with `PEER_FAILURE_EXIT_CODE`, so that nothing ever hangs.
A worker that ends cleanly posts a signed "left" key, and rank 0 keeps the store up until every
peer has left or is known dead (having posted a signed "ending" key first, so that a peer waiting
for it to act, such as a save, learns that it will not). A worker whose interpreter ends while a
failure is known is ended `EXIT_SECONDS` later if its cleanup still runs (`_exit_deadline.py`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from meshfit._runtime import PEER_FAILURE_EXIT_CODE
from meshfit.distribute._liveness._bounded_store import BoundedStore
from meshfit.distribute._liveness._exit_deadline import (
    EXIT_SECONDS,
    end_within,
    interpreter_exiting,
    tell_at_exit,
)
from meshfit.distribute._liveness._failure import FailureState

__all__ = ["PEER_FAILURE_EXIT_CODE", "Heartbeat", "PeerFailureError"]

_GRACE_SECONDS = 1.5
_SHORTEST_REQUEST = 0.2  # the least time a store request is given (an answer takes a millisecond)
_PAST_DUE = 0.05  # a request bounded by a deadline ends this much after it, so the silence has reached it
_FIRST_BEAT_FACTOR = 2.0  # a peer never heard from gets this many timeouts (see the module docstring)
_KEPT_BEATS = 64  # beats kept in the store per rank, so a lagging watcher still finds the next one
_PREFIX = "meshfit/hb"


class PeerFailureError(RuntimeError):
    """A worker of the group stopped (killed, crashed, frozen or unreachable)."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


def report_uncaught_peer_failures() -> None:
    """An uncaught `PeerFailureError` ends the worker with its message alone, not a traceback into
    meshfit's internals (the message names the peer and the backup). Installed when a group of
    several processes forms, never at import; other exceptions go to the previous hook."""
    if not isinstance(sys.excepthook, _PeerFailureHook):
        sys.excepthook = _PeerFailureHook(sys.excepthook)


class _PeerFailureHook:
    """``sys.excepthook`` printing a `PeerFailureError`'s message alone and ending the process with
    `PEER_FAILURE_EXIT_CODE`, as the watchdog does, so that a launcher can tell the worker that
    followed a failure from the one that failed; other exceptions go to ``previous``.

    The interpreter ends with the code of a `SystemExit` raised by its ``sys.excepthook``, after its
    usual shutdown (non-daemon threads joined, ``atexit`` handlers run). An interactive session
    (``python -i``, `code.interact`) goes on: there the hook prints the message alone."""

    def __init__(self, previous: Callable[..., Any]) -> None:
        self.previous = previous

    def __call__(self, kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        if isinstance(value, PeerFailureError):
            print(f"meshfit: {type(value).__name__}: {value}", file=sys.stderr, flush=True)
            if not (sys.flags.inspect or hasattr(sys, "ps1")):  # interactive: the prompt comes back
                raise SystemExit(PEER_FAILURE_EXIT_CODE)
            return
        self.previous(kind, value, traceback)


class _Peer:
    """What a watcher knows of one peer."""

    def __init__(self, now: float) -> None:
        self.count = 0
        self.step = "?"
        self.seen = now
        self.left = False


class Heartbeat:
    """Publishes this rank's heartbeat and watches the others' (see the module docstring).

    Args:
        connect: opens the watchdog's own connection to the rendezvous store.
        rank: this worker's rank.
        world_size: the number of workers.
        timeout: seconds of silence after which a peer is declared dead.
        failure_state: this worker's step and backup, for messages.
        secret: the job's shared secret (the same bytes on every rank).
        names: a description of each rank for messages (default ``"rank r"``).
        store_host: the rank whose process hosts the store (``None``: an outside process does).
        interval: seconds between beats (default ``timeout / 5`` within 0.2–1 s).
    """

    def __init__(self, connect: Callable[[], Any], rank: int, world_size: int, timeout: float,
                 failure_state: FailureState, secret: bytes, names: Sequence[str] | None = None,
                 store_host: int | None = 0, interval: float | None = None) -> None:
        self._connect, self._rank, self._world = connect, rank, world_size
        self._timeout = float(timeout)
        self._interval = interval or max(0.2, min(1.0, self._timeout / 5))
        self._request_timeout = max(1.0, self._timeout / 2)
        self._stores: list[BoundedStore] = []  # every connection's thread, joined by `stop`
        self._store = self._new_store()
        self._state = failure_state
        self._secret = secret
        self._names = list(names) if names is not None else [f"rank {r}" for r in range(world_size)]
        self._store_host = store_host
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.failure: PeerFailureError | None = None
        self.handled = False
        self._count = 0
        self._watching = 0
        now = time.monotonic()
        self._peers = {p: _Peer(now) for p in range(world_size) if p != rank}
        self.liveness: Any = None  # a `Liveness` (its connections' ends name killed peers at once), if any
        self._thread = threading.Thread(target=self._run, daemon=True, name="meshfit-heartbeat")
        self._thread.start()
        tell_at_exit(self)  # `ending`, when the interpreter begins to end

    def _new_store(self) -> BoundedStore:
        self._stores = [s for s in self._stores if s.alive()]
        self._stores.append(BoundedStore(self._connect, self._request_timeout))
        return self._stores[-1]

    # ---- keys ---------------------------------------------------------------------------------
    def _mac(self, rank: int, what: str) -> str:
        return hmac.new(self._secret, f"{rank}/{what}".encode(), hashlib.sha256).hexdigest()[:20]

    def _beat_key(self, rank: int, count: int) -> str:
        return f"{_PREFIX}/{rank}/{count}.{self._mac(rank, str(count))}"

    def _left_key(self, rank: int) -> str:
        return f"{_PREFIX}/{rank}/left.{self._mac(rank, 'left')}"

    def _ending_key(self, rank: int) -> str:
        """Posted by the store's host when its script has ended and it only keeps the store up for peers."""
        return f"{_PREFIX}/{rank}/ending.{self._mac(rank, 'ending')}"

    # ---- the watchdog thread -----------------------------------------------------------------------
    def _beat(self, store: Any) -> None:
        self._count += 1
        current = self._state.current_step()
        step = "?" if current is None else str(current)
        store.set(self._beat_key(self._rank, self._count), step)
        store.set(f"{_PREFIX}/{self._rank}", str(self._count))
        if self._count > _KEPT_BEATS:
            store.delete_key(self._beat_key(self._rank, self._count - _KEPT_BEATS))

    def _round(self, store: Any, looking: bool) -> None:
        """One round trip's work: beat, then look at every peer still running."""
        self._beat(store)
        if looking:
            now = time.monotonic()
            for rank, peer in self._peers.items():
                if not peer.left:
                    self._look(store, rank, peer, now)

    def _have_left(self, ranks: list[int], store: Any) -> list[int]:
        return [r for r in ranks if store.check([self._left_key(r)])]

    def _look(self, store: Any, rank: int, peer: _Peer, now: float) -> None:
        """Advance ``peer`` to its newest genuine beat, if it beat since we last looked."""
        candidates = []
        try:
            hint = int(store.get(f"{_PREFIX}/{rank}")) if store.check([f"{_PREFIX}/{rank}"]) else 0
        except ValueError:
            hint = 0  # not a number: not written by meshfit
        if hint > peer.count + 1:
            candidates.append(hint)  # the newest beat, if genuine
        candidates.append(peer.count + 1)
        for count in candidates:
            key = self._beat_key(rank, count)
            if store.check([key]):
                peer.count, peer.seen = count, now
                peer.step = store.get(key).decode(errors="replace")[:20] or "?"
                return
        if now - peer.seen > self._timeout / 2 and store.check([self._left_key(rank)]):
            peer.left = True

    def _run(self) -> None:
        started = time.monotonic()
        last_answer = started
        declared_at: float | None = None

        def pause() -> float:  # until the next round, or until the grace after a declaration ends
            remaining = -1.0 if declared_at is None else declared_at + _GRACE_SECONDS - time.monotonic()
            return min(self._interval, remaining) if remaining > 0 else self._interval

        while not self._stop.wait(pause()):
            now = time.monotonic()
            if declared_at is None and self.failure is not None:  # `peer_ended` declared it
                declared_at = now
            if declared_at is not None and now - declared_at >= _GRACE_SECONDS:
                self._end_if_blocked()
            # No request outlasts the moment the next decision is due: the store's silence reaching
            # the timeout, or the end of the grace after a declaration. After that, the beats that go on
            # (so that no peer blames this worker) get the whole request bound.
            due: float | None = last_answer + self._timeout
            if declared_at is not None:
                grace_ends = declared_at + _GRACE_SECONDS
                due = grace_ends if now < grace_ends else None
            bound = self._request_timeout if due is None else max(_SHORTEST_REQUEST, due - now + _PAST_DUE)
            try:
                # Keep beating after a failure, so that no peer blames this worker.
                self._store.call(functools.partial(self._round, looking=declared_at is None), bound)
                last_answer = now = time.monotonic()
                if declared_at is not None:
                    continue
                for rank, peer in self._peers.items():
                    silent = now - peer.seen
                    limit = self._timeout if peer.count else self._timeout * _FIRST_BEAT_FACTOR
                    if not peer.left and silent > limit and now - started > limit:
                        since = "" if peer.count else " since it joined"
                        self._declare(rank, peer.step, f"sent no heartbeat for {silent:.1f} s{since}: it is "
                                                       "dead, frozen or unreachable")
                        declared_at = now
                        break
            except Exception as error:  # the store did not answer, or not in time
                self._store.close()  # its thread ends once the request it is stuck in returns
                if self._stop.is_set():
                    return
                self._store = self._new_store()  # a fresh connection
                silent = time.monotonic() - last_answer
                if self._stop.is_set() or declared_at is not None or silent < self._timeout:
                    continue
                host = self._store_host
                step = self._peers[host].step if host in self._peers else "?"
                who = "The rendezvous store stopped" if host is None else None
                self._declare(host, step, f"its rendezvous store did not answer for {silent:.1f} s "
                                          f"({type(error).__name__}): it is dead, frozen or unreachable", who)
                declared_at = time.monotonic()

    def _declare(self, peer: int | None, last_step: str, why: str, who: str | None = None) -> None:
        where = self._state.where_to_resume()
        current = self._state.current_step()
        if who is None and peer is not None:
            who = f"Worker {peer} stopped ({self._names[peer]})"
        reported = "it had reported no step" if last_step == "?" else f"its last reported step: {last_step}"
        here = "has run no step" if current is None else f"is at step {current}"
        message = f"{who}: {why} ({reported}; this worker, {self._names[self._rank]}, {here}). {where}"
        with self._lock:
            self.failure = PeerFailureError(message, rank=peer)
        if interpreter_exiting():  # found while this process ends: its cleanup may wait on that peer
            self.ending()

    def peer_ended(self, rank: int) -> None:
        """``rank``'s process is gone: its liveness connection closed without a goodbye (`Liveness`)."""
        if self.failure is None and rank in self._peers and not self._peers[rank].left:
            self._declare(rank, self._peers[rank].step, "its process ended (killed or crashed): its "
                                                       "connection closed without a goodbye")

    def has_left(self, rank: int) -> bool:
        """Whether ``rank`` said it left cleanly (its process ended or is ending), asked of the store now.

        The store's host says so before it waits for its peers to finish (`stop`): a peer waiting for
        it to act (a save, an every-worker call) learns that it will not.
        """
        if rank in self._peers and self._peers[rank].left:
            return True
        try:
            return bool(self._store.call(lambda store: store.check([self._left_key(rank)])
                                         or store.check([self._ending_key(rank)])))
        except Exception:  # noqa: BLE001 - the store did not answer: the watchdog names that failure
            return False

    def ending(self) -> None:
        """This process's interpreter is ending: with a failure known, give its cleanup `EXIT_SECONDS`,
        then end it (`end_within`), for that cleanup may wait on a collective that never completes."""
        if self.failure is not None and not self._stop.is_set():
            end_within(EXIT_SECONDS, f"this worker ({self._names[self._rank]})")

    def _end_if_blocked(self) -> None:
        """The main thread did not pick the failure up while in a watched region: it is blocked in a
        collective. Never hang: print the message and end the process."""
        if self.handled or not self._watching or self.failure is None:
            return
        print(f"meshfit: {self.failure}", file=sys.stderr, flush=True)
        os._exit(PEER_FAILURE_EXIT_CODE)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """A region (training, a collective, a save) in which a detected failure that the main thread
        does not pick up within the grace period ends the process instead of waiting."""
        self._watching += 1
        try:
            yield
        finally:
            self._watching -= 1

    # ---- the main thread's side ------------------------------------------------------------------
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
            if not self._thread.is_alive():
                return None
            time.sleep(0.05)
        return None

    def stop(self, wait_for_peers: float = 0.0) -> None:
        """Stop beating and say this worker left cleanly.

        Args:
            wait_for_peers: on the store's host, how long to keep the store up for peers still running
                (until each has left or fallen silent for the timeout).
        """
        if self._stop.is_set():
            return
        if wait_for_peers > 0 and self.failure is None:
            with contextlib.suppress(Exception):  # the store is ours: it answers, unless it is broken
                self._store.call(lambda store: store.set(self._ending_key(self._rank), "1"))
            self._wait_for_peers(wait_for_peers)
        if self.liveness is not None:
            self.liveness.stop(goodbye=self.failure is None)
        self._stop.set()
        self._thread.join(timeout=self._request_timeout + self._interval + 1)
        if self.failure is None:
            if self._store.closed:  # the watchdog dropped it as it stopped
                self._store = self._new_store()
            with contextlib.suppress(Exception):  # the store may be gone already: nothing to tell
                self._store.call(lambda store: store.set(self._left_key(self._rank), "1"))
        # No thread of ours may be inside a store request when the interpreter finalises: a request
        # returning then ends its thread by pthread_exit, whose unwinding through torch's C++ aborts
        # the process ("terminate called without an active exception", exit code -6). A request to a
        # live store returns within moments; one to a frozen store never returns, which is harmless.
        deadline = time.monotonic() + (self._timeout if self.failure is None else 1.0)
        for store in self._stores:
            store.close()
        for store in self._stores:
            store.join(max(0.0, deadline - time.monotonic()))

    def _wait_for_peers(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        last_message = time.monotonic()
        while time.monotonic() < deadline and self.failure is None and self._thread.is_alive():
            running = [r for r, p in self._peers.items() if not p.left]
            if not running:
                return
            try:
                left = self._store.call(functools.partial(self._have_left, running))
            except Exception:
                return
            for rank in left:
                self._peers[rank].left = True
            if time.monotonic() - last_message > 10:
                last_message = time.monotonic()
                names = ", ".join(self._names[r] for r in running)
                print(f"meshfit: {self._names[self._rank]} hosts the rendezvous store and waits for {names} "
                      "to finish", file=sys.stderr, flush=True)
            time.sleep(0.05)
