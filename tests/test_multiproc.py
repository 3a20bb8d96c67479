"""The test helper itself: `run_distributed`'s ranks are new processes that see the caller's environment of
the moment, a rank's exception comes back with its traceback, a hung rank times out and is ended, and none
of it leaves a process behind or breaks the next call."""

from __future__ import annotations

import gc
import os
import time

import pytest
from _multiproc import ChildProcessError_, helper_pids, run_distributed

from meshfit._runtime import FORK_SERVER_ENV


def _report(rank, world_size):
    import torch
    import torch.distributed as dist

    import meshfit as mf
    from meshfit.distribute._scope import is_default_strategy

    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return {"pid": os.getpid(), "sum": total.item(), "var": os.environ.get("MULTIPROC_PROBE"),
            "extra": os.environ.get("MULTIPROC_EXTRA"), "threads": torch.get_num_threads(),
            "default_strategy": is_default_strategy(mf.get_strategy()), "dtype": str(torch.get_default_dtype()),
            "frozen": gc.get_freeze_count(), "marker": os.environ.get(FORK_SERVER_ENV)}


def _dirty(rank, world_size):
    import torch

    import meshfit as mf

    torch.set_default_dtype(torch.float64)
    mf.distribute.OneDeviceStrategy("cpu").scope().__enter__()  # never left
    os.environ["MULTIPROC_PROBE"] = "left behind"
    return os.getpid()


def _raise(rank, world_size):
    if rank == 1:
        raise ValueError("rank one says no")
    return rank


def _hang(rank, world_size):
    time.sleep(600)


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_ranks_are_fresh_processes_with_the_callers_environment(monkeypatch, start_method):
    monkeypatch.setenv("MULTIPROC_PROBE", "now")
    dirty = run_distributed(_dirty, start_method=start_method)
    first, second = run_distributed(_report, env={"MULTIPROC_EXTRA": "x"}, start_method=start_method)
    assert first["sum"] == second["sum"] == 3.0
    assert len({first["pid"], second["pid"], *dirty}) == 4  # new processes every call
    for got in (first, second):
        # The earlier call's env var, default dtype and strategy scope stayed in its own processes.
        assert (got["var"], got["extra"], got["threads"]) == ("now", "x", 1)
        assert (got["default_strategy"], got["dtype"]) == (True, "torch.float32")
        # A forked rank starts with the server's imports frozen (its collections skip them); a new
        # interpreter with nothing frozen. The server's marker variable reaches neither.
        assert (got["frozen"] > 100_000) == (start_method == "forkserver") and got["marker"] is None, got


def test_a_rank_that_raises_comes_back_with_its_traceback_and_the_next_call_works():
    with pytest.raises(ChildProcessError_, match=r"(?s)rank 1 failed.*ValueError: rank one says no"):
        run_distributed(_raise)
    assert run_distributed(_raise, world_size=1) == [0]


def test_a_hung_rank_times_out_is_ended_and_the_next_call_works():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="within 3s"):
        run_distributed(_hang, timeout=3)
    assert time.monotonic() - started < 60
    assert run_distributed(_raise, world_size=1) == [0]


def test_the_fork_server_is_single_threaded_so_forking_it_is_safe():
    run_distributed(_raise, world_size=1)  # starts the server if no earlier test did
    from multiprocessing import forkserver

    pid = forkserver._forkserver._forkserver_pid
    assert pid in helper_pids()
    assert len(os.listdir(f"/proc/{pid}/task")) == 1  # a preloaded module that starts a thread fails here
