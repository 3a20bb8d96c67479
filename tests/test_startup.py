"""Hand-started workers on one host: torch threads shared among them, torch's retry noise hidden."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time

import pytest
from _procs import child_env, finish, free_ports, start, tf_config

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "threads_probe.py")


def _default_threads() -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return int(out)


def _read_until(proc, text: str, timeout: float) -> str:
    """``proc``'s output up to the first line holding ``text`` (or all it wrote within ``timeout``)."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = proc.stdout.readline() if ready else ""
        if not line:
            break
        seen.append(line)
        if text in line:
            break
    return "".join(seen)


def _workers(extra_args: list[str], env: dict[str, str], chief_after: str | None = None) -> list[str]:
    """Worker 1's and worker 0's output; with ``chief_after``, worker 0 starts once worker 1 printed it."""
    ports = free_ports(2)
    procs, early = [], ""
    for index in (1, 0):  # worker 1 first: it waits for the chief, the case whose output drowned
        procs.append(start([SCRIPT, *extra_args], {**env, "TF_CONFIG": tf_config(ports, index)}, fresh=True))
        if index == 1 and chief_after is not None:
            early = _read_until(procs[0], chief_after, timeout=150)
    outputs = []
    for proc in procs:
        code, out = finish(proc, timeout=180)
        out = (early + out) if proc is procs[0] else out
        assert code == 0, out
        outputs.append(out)
    return outputs  # worker 1's, worker 0's


def _threads(output: str) -> int:
    return int(re.search(r"^THREADS (\d+)", output, re.M).group(1))


def test_co_located_hand_started_workers_share_the_cores():
    default = _default_threads()
    expected = max(1, (os.cpu_count() or 1) // 2)
    if expected >= default:
        pytest.skip(f"torch uses {default} thread(s) here: nothing to share")
    env = child_env()
    env.pop("OMP_NUM_THREADS")  # started by hand, as the tutorial does
    outputs = _workers([], env)
    assert [_threads(out) for out in outputs] == [expected, expected], outputs
    said = [out.count("workers of this job share this host") for out in outputs]
    assert sorted(said) == [0, 1], outputs  # said once for the host, by its first worker
    assert f"torch.set_num_threads({expected})" in outputs[1]


def test_threads_the_user_chose_are_kept():
    env = child_env(OMP_NUM_THREADS="2")
    assert [_threads(out) for out in _workers([], env)] == [2, 2]
    env.pop("OMP_NUM_THREADS")
    chosen = _default_threads() + 1  # a value torch would not pick by itself
    outputs = _workers([str(chosen)], env)  # torch.set_num_threads(chosen) in the script
    assert [_threads(out) for out in outputs] == [chosen, chosen]
    assert not any("share this host" in out for out in outputs)


def test_waiting_for_peers_hides_torchs_connection_retries():
    env = child_env()
    outputs = _workers([], env, chief_after="is waiting for")
    waiting = outputs[0]  # worker 1 waited for the chief's store until it said so
    assert "is waiting for" in waiting, waiting
    assert "[c10d]" not in waiting and "frame #" not in waiting, waiting
    assert "THREADS" in waiting  # stderr and stdout are back afterwards
