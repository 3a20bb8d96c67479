"""The process runtime: the supervisor that starts, prefixes and stops worker processes (for
`meshfit launch` and self-spawned replicas), the launcher, exit codes, a worker's fast exit, the
allocator setting, and the floating-point mode of the threads that run a model (denormals flushed to
zero, as in TF).

A private layer package: meshfit's other packages import the names below from here, never its
``_``-modules; users import the public names from `meshfit`.
"""

from meshfit._runtime._allocator import keep_freed_memory
from meshfit._runtime._denormals import FLUSH_DENORMALS_ENV, flush_denormals, flushing_denormals
from meshfit._runtime._exit_codes import PEER_FAILURE_EXIT_CODE, PREEMPTED_EXIT_CODE
from meshfit._runtime._exit_heap import FREEZE_HEAP_AT_EXIT_ENV, freeze_heap_at_exit
from meshfit._runtime._launch import main
from meshfit._runtime._ports import free_ports
from meshfit._runtime._preload import FORK_SERVER_ENV
from meshfit._runtime._supervisor import (
    FORWARDED_TERMINAL_ENV,
    LocalReplicas,
    replica_identity,
    spawn_local_replicas,
    watch_parent,
)
from meshfit._runtime._threads_at_import import note_threads_at_import, threads_at_import

__all__ = [
    "FLUSH_DENORMALS_ENV",
    "FORK_SERVER_ENV",
    "FORWARDED_TERMINAL_ENV",
    "FREEZE_HEAP_AT_EXIT_ENV",
    "LocalReplicas",
    "PEER_FAILURE_EXIT_CODE",
    "PREEMPTED_EXIT_CODE",
    "flush_denormals",
    "flushing_denormals",
    "free_ports",
    "freeze_heap_at_exit",
    "keep_freed_memory",
    "main",
    "note_threads_at_import",
    "replica_identity",
    "spawn_local_replicas",
    "threads_at_import",
    "watch_parent",
]
