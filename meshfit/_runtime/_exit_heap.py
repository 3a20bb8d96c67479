"""A worker's interpreter ends without walking torch's object graph again.

When Python shuts down it clears every module and runs its cyclic garbage collector over every
tracked object, several times, whether or not the collector is enabled. A process that imported
torch, ``torch._dynamo`` and ``torch.distributed.checkpoint`` (as a training worker does) tracks
hundreds of thousands of objects: here that shutdown took 1.3-1.5 s after the last line of the
script had run, a second and more added to the end of every job and to every restart's wait for
the old round to go.

`freeze_heap_at_exit`, which a worker's world calls after its own shutdown at exit, collects the
garbage there is once (every finalizer of an unreachable object runs, with the interpreter still
whole) and then moves every object into the collector's permanent generation (`gc.freeze`), which
shutdown's collections skip: 0.4-0.5 s in all (the collection 0.2 s of it) instead of 1.3-1.5 s
(``bench/bench_exit.py``). Objects that become unreachable only while the modules are cleared are
then released by reference counting alone; one inside a reference cycle is not finalized (its memory
goes back with the process). A file the script left open inside such a
cycle is the one thing that could notice: close files, or open them with ``with``, as Python's
documentation asks anyway. ``MESHFIT_FREEZE_HEAP_AT_EXIT=0`` in the environment keeps Python's own
shutdown.
"""

from __future__ import annotations

import gc
import os

__all__ = ["FREEZE_HEAP_AT_EXIT_ENV", "freeze_heap_at_exit"]

FREEZE_HEAP_AT_EXIT_ENV = "MESHFIT_FREEZE_HEAP_AT_EXIT"
_OFF = {"0", "false", "no", "off"}


def freeze_heap_at_exit() -> bool:
    """Collect garbage once, then freeze the heap (see the module docstring); returns whether it did.

    Call it only while the process exits (an `atexit` handler): a frozen object that becomes garbage
    later is never collected.
    """
    if os.environ.get(FREEZE_HEAP_AT_EXIT_ENV, "1").strip().lower() in _OFF:
        return False
    gc.collect()
    gc.freeze()
    return True
