"""`save_barrier`: a worker's ``model.save`` returns only once the chief's matching save is complete.

TensorFlow's ``model.save`` under a strategy is collective, so its tutorial loads the chief's file on
every worker right after saving (each worker saves, the non-chiefs to a temporary path they delete,
then ``load_model(model_path)``). PyTorch users write ``if rank == 0: model.save(path)``, where the
other workers never call ``save``. Both must work: the chief never waits for anyone (a chief-alone
save cannot hang), and another worker's call waits for the chief's. Nothing here is a collective:
the two sides meet through the job's rendezvous store (`World.store`).

- The chief counts each save it starts, runs it, then records its outcome and counts it done (done
  whether it was written or failed, so a waiting worker never waits for a save that ended).
- Another worker counts its own calls. Its ``n``-th returns once the chief has completed ``n`` saves,
  and also the save the chief was in when the call came (when the chief runs ahead, its current
  save is the one this call matches). It raises if that save failed on the chief
  (`ChiefWriteError`), if the chief stopped (the heartbeat's `PeerFailureError`), ended without
  making it, or did not make it within the world's timeout (`EveryWorkerCallError`).

The counts match when every worker makes the same saves (TensorFlow's habit) and do not matter when
only the chief saves (PyTorch's). A program that mixes them (the chief saving alone first, then every
worker saving) may see a worker return before the chief's newest save began: such a program should
call ``strategy.barrier()`` before reading that file.

Store keys (on the job's default store; the chief is rank 0)::

    meshfit/saves/started          how many saves the chief started (store.add)
    meshfit/saves/done             how many of them ended, written or failed (store.add)
    meshfit/saves/outcome/<n>      "" when the chief's save <n> was written, else its error
    meshfit/saves/calls/<rank>     how many saves worker <rank> (not the chief) called (store.add)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from meshfit._protocols import DistributionStrategy
from meshfit._saving._every_worker import EveryWorkerCallError
from meshfit._storage import ChiefWriteError

_PREFIX = "meshfit/saves"
_CHIEF_RANK = 0  # the chief of a group is rank 0 (`meshfit.cluster`: the chief task, else worker 0)
_FIRST_POLL_SECONDS = 0.005  # a small model's save takes milliseconds: look soon, then less often
_LAST_POLL_SECONDS = 0.1


@contextlib.contextmanager
def save_barrier(strategy: DistributionStrategy, call: str, what: str) -> Iterator[None]:
    """Run the save inside; on a worker that is not the chief, return after the chief's matching save.

    Args:
        strategy: the model's strategy (its ``world``: rank, size, store, heartbeat, timeout).
        call: the call in the user's words, ``"model.save"``.
        what: the save in words, for errors (``"save the model to '/x'"``).

    Raises:
        ChiefWriteError: on a worker that is not the chief, when the chief's matching save failed.
        EveryWorkerCallError: the chief ended without making the matching save, or did not make it
            within the world's timeout.
        PeerFailureError: the chief stopped (killed, crashed, frozen) while this worker waited.
    """
    world = strategy.world
    if world.size <= 1:
        yield
        return
    store = world.store()
    if strategy.is_chief:
        number = int(store.add(f"{_PREFIX}/started", 1))
        outcome = "unfinished"
        try:
            yield
            outcome = ""
        except BaseException as error:
            outcome = f"{type(error).__name__}: {error}"
            raise
        finally:
            store.set(f"{_PREFIX}/outcome/{number}", outcome)
            store.add(f"{_PREFIX}/done", 1)
        return
    with strategy.guard():  # a chief that dies meanwhile is named, and a frozen store cannot hang us
        number = int(store.add(f"{_PREFIX}/calls/{world.rank}", 1))
        target = max(number, int(store.add(f"{_PREFIX}/started", 0)))
    yield  # a replicated model: nothing to write here
    with strategy.guard():
        _wait_for_chief(world, store, target, call)
        failure = store.get(f"{_PREFIX}/outcome/{target}").decode(errors="replace")
    if failure:
        raise ChiefWriteError(f"Could not {what}: the chief's matching {call} failed with {failure}")


def _wait_for_chief(world: Any, store: Any, target: int, call: str) -> None:
    """Return once the chief has completed ``target`` saves; raise when it cannot any more."""
    deadline = time.monotonic() + world.timeout.total_seconds()
    heartbeat = world.heartbeat
    pause = _FIRST_POLL_SECONDS
    chief = f"the chief ({world.names[_CHIEF_RANK]})"

    def done() -> bool:
        return int(store.add(f"{_PREFIX}/done", 0)) >= target

    def fail(problem: str) -> EveryWorkerCallError:
        return EveryWorkerCallError(
            f"{call} on {world.names[world.rank]} returns once the chief's matching save is complete, so that "
            f"every worker can load the file right after; but {problem}. Call {call} on every worker "
            f"(as TensorFlow does) or on the chief alone (`if task_id == 0:`), not on other workers alone.")

    while not done():
        if heartbeat is not None:
            heartbeat.check()  # the chief (or another worker) stopped: PeerFailureError names it
            if heartbeat.has_left(_CHIEF_RANK) and not done():
                raise fail(f"{chief} ended without making its save number {target}")
        if time.monotonic() > deadline:
            raise fail(f"{chief} did not make its save number {target} within "
                       f"{world.timeout.total_seconds():.0f} s")
        time.sleep(pause)
        pause = min(pause * 2, _LAST_POLL_SECONDS)
