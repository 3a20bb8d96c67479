"""`require_every_worker`: a call that needs every worker finds out at once when one is not coming.

A replicated model's ``save``, ``evaluate`` and ``predict`` need no other worker (meshfit runs them on
the calling worker alone). A model whose weights are sharded across the workers (`meshfit.dtensor`
layouts, ``LayoutMap.fully_sharded``) cannot: saving gathers each worker's shards, a forward pass
all-gathers them. PyTorch users often write ``if rank == 0: model.save(path)``; without a check the
chief would block in a collective the others never join, then die of a raw gloo error. Before such
a collective every worker posts the call through the rendezvous store (no collective), and waits
until each peer posted the same call; a peer that ended (left cleanly or died), or that made another
call, makes the caller raise `EveryWorkerCallError` at once, naming the call and the fix.

Store keys (on the job's default store)::

    meshfit/every-worker/<rank>            how many such calls <rank> made (store.add)
    meshfit/every-worker/<rank>/<count>    the name of <rank>'s call number <count>
"""

from __future__ import annotations

import time
from typing import Any

from meshfit._lazy_dtensor import is_dtensor
from meshfit._protocols import DistributionStrategy

_PREFIX = "meshfit/every-worker"
_POLL_SECONDS = 0.05


class EveryWorkerCallError(RuntimeError):
    """A call that needs every worker was made on some workers only."""


def require_every_worker(strategy: DistributionStrategy, call: str, why: str) -> None:
    """Return once every worker made ``call`` too; raise at once when one cannot.

    Args:
        strategy: the model's strategy (its ``world``: rank, size, names, heartbeat, timeout).
        call: the call in the user's words, ``"model.save"``.
        why: why it needs every worker, for the error.

    Raises:
        EveryWorkerCallError: a peer ended, or made another call, or did not come within the
            world's timeout.
    """
    world = strategy.world
    if world.size <= 1:
        return
    store = world.store()
    count = int(store.add(f"{_PREFIX}/{world.rank}", 1))
    store.set(f"{_PREFIX}/{world.rank}/{count}", call)
    waiting = [r for r in range(world.size) if r != world.rank]
    deadline = time.monotonic() + world.timeout.total_seconds()
    heartbeat = world.heartbeat

    def fail(problem: str) -> EveryWorkerCallError:
        return EveryWorkerCallError(
            f"{call} needs every worker: {why}. {problem} Call {call} on every worker (not only "
            f"inside `if task_id == 0:`); the chief alone writes what is saved.")

    while waiting:
        for rank in list(waiting):
            if int(store.add(f"{_PREFIX}/{rank}", 0)) >= count:
                theirs = store.get(f"{_PREFIX}/{rank}/{count}").decode(errors="replace")
                if theirs != call:
                    raise fail(f"Worker {rank} ({world.names[rank]}) called {theirs} instead.")
                waiting.remove(rank)
            elif heartbeat is not None and heartbeat.has_left(rank):
                raise fail(f"Worker {rank} ({world.names[rank]}) ended without calling it.")
        if not waiting:
            return
        if heartbeat is not None and heartbeat.failure is not None:
            raise fail(f"A worker stopped: {heartbeat.failure}")
        if time.monotonic() > deadline:
            names = ", ".join(f"worker {r} ({world.names[r]})" for r in waiting)
            raise fail(f"{names} did not call it within {world.timeout.total_seconds():.0f} s.")
        time.sleep(_POLL_SECONDS)


def is_sharded(module: Any) -> bool:
    """Whether any of ``module``'s parameters or buffers is split across processes (a DTensor)."""
    return any(is_dtensor(t) for t in (*module.parameters(), *module.buffers()))


def split_across_workers(model: Any) -> bool:
    """Whether a model's state is split across processes: a DTensor, or a placement whose `Residency`
    gives each rank some of the paths (pipeline stages). Reading the whole state needs every worker."""
    return is_sharded(model.module) or not model.residency.everywhere
