"""Run a function on N real processes joined in a gloo process group (file:// rendezvous).

Used by the tests as PyTorch's ``DTensorTestBase`` and Accelerate's ``debug_launcher`` are: a fresh
process per rank, ``OMP_NUM_THREADS=1``, a timeout, child exceptions re-raised in the parent, process
groups destroyed in ``finally``, and no child left behind.

The ranks are forked from a fork server (multiprocessing's ``forkserver``) that imported torch, meshfit
and pytest once for the whole session: a rank costs a fork, not a new interpreter plus ``import torch``
(1-5 s each on a loaded 2-core machine). Each rank is still a new process that has run nothing: no
strategy, policy, process group, thread pool or seed carries over from an earlier test. The rank gets
the caller's environment of the moment (not the server's, which froze when it started) plus ``env``.
``start_method="spawn"`` gives a test a new interpreter instead (e.g. one that must import torch under
its own environment variables).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import forkserver, resource_tracker
from typing import Any

import _warm

from meshfit._runtime import FORK_SERVER_ENV

# Imported once in the fork server (single-threaded: importing them starts no thread, so forking is
# safe); anything else a test module imports, each rank imports for itself. The last one freezes what the
# server imported (gc.freeze), as `meshfit launch --preload`'s fork server does: a rank's collections then
# skip torch's objects and leave their pages shared with the server. Measured here on a 2-rank tiny fit:
# 0.43 s of CPU a rank without it, 0.17 s with it.
_PRELOAD = [*_warm.PRELOAD, "pytest", "meshfit._runtime._fork_server_heap"]
_SERVER_ENV = {"OMP_NUM_THREADS": "1",  # the server imports torch once: with one OpenMP thread, as every rank runs
               FORK_SERVER_ENV: "1"}  # only the server freezes its heap (not this process, not a rank)


class ChildProcessError_(RuntimeError):
    """A child raised: carries the child's rank and traceback."""


def _child(fn: Callable[..., Any], rank: int, world_size: int, init_file: str, args: tuple,
           env: dict[str, str], results: mp.Queue) -> None:
    os.environ.clear()
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60))
        try:
            # Every rank has joined before any runs `fn`: a rank whose `fn` returns at once would
            # otherwise close its connections while a slower peer is still handshaking in gloo.
            dist.barrier()
            value = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException:  # report everything to the parent, which re-raises
        results.put((rank, "error", traceback.format_exc()))


def _forkserver_context() -> Any:
    """The fork-server context, its server started with the modules above imported single-threaded."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    saved = {name: os.environ.get(name) for name in _SERVER_ENV}
    os.environ.update(_SERVER_ENV)
    try:
        forkserver.ensure_running()
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    return ctx


def helper_pids() -> set[int]:
    """The session-long helper processes (multiprocessing's fork server and resource tracker, the warm
    interpreter of tests/_warm.py), if started.

    They are no test's leak: the conftest guard leaves them alone. Their own children (the ranks) are
    still the test's to end.
    """
    pids = {getattr(forkserver._forkserver, "_forkserver_pid", None),
            getattr(resource_tracker._resource_tracker, "_pid", None), _warm.server_pid()}
    return {pid for pid in pids if pid is not None}


def run_distributed(fn: Callable[..., Any], world_size: int = 2, args: tuple = (), timeout: float = 120.0,
                    env: dict[str, str] | None = None, start_method: str = "forkserver") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results by rank."""
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"Invalid `start_method`: expected 'forkserver' or 'spawn', received "
                         f"start_method={start_method!r}.")
    ctx = _forkserver_context() if start_method == "forkserver" else mp.get_context("spawn")
    results = ctx.Queue()
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, init_file, args, child_env, results),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        errors: list[str] = []
        try:
            for _ in range(world_size):
                try:
                    rank, status, value = results.get(timeout=timeout)
                except queue.Empty:
                    errors.append("timed out")  # nothing more to wait for below
                    raise TimeoutError(f"run_distributed: no result from some ranks within {timeout}s; "
                                       f"got ranks {sorted(out)}") from None
                if status == "ok":
                    out[rank] = value
                else:
                    errors.append(f"rank {rank} failed:\n{value}")
                    break
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
            results.close()
        if errors:
            raise ChildProcessError_("\n".join(errors))
        return [out[r] for r in range(world_size)]
