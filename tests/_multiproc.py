"""Run a function on N real processes joined in a gloo process group (file:// rendezvous).

Used by the tests as PyTorch's ``DTensorTestBase`` and Accelerate's ``debug_launcher`` are: spawn,
``OMP_NUM_THREADS=1``, a timeout, child exceptions re-raised in the parent, process groups destroyed
in ``finally``, and no child left behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


class ChildProcessError_(RuntimeError):
    """A child raised: carries the child's rank and traceback."""


def _child(fn: Callable[..., Any], rank: int, world_size: int, init_file: str, args: tuple,
           env: dict[str, str], results: mp.Queue) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60))
        try:
            value = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException:  # report everything to the parent, which re-raises
        results.put((rank, "error", traceback.format_exc()))


def run_distributed(fn: Callable[..., Any], world_size: int = 2, args: tuple = (), timeout: float = 120.0,
                    env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child_env = {"OMP_NUM_THREADS": "1", **(env or {})}
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
