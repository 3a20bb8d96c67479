"""Start worker scripts as real processes for tests: free ports, timeouts, nothing left behind."""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import _warm

from meshfit._runtime import _ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BLOCK = 1500  # ports per pytest-xdist worker
# Below the ports `meshfit launch` picks for itself (the upper half below the ephemeral range,
# meshfit._runtime._ports): a launcher in one test never takes a port another test picked.
_FIRST = 10000


def _worker_index() -> int:
    match = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    return int(match.group(1)) if match else 0


_cursor = itertools.count()


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Distinct ports free on ``host`` now, for workers the test starts.

    Taken in turn from a block of ports below the kernel's ephemeral range, one block per pytest-xdist
    worker: an outgoing connection of any process (gloo's among them) is never given one, and two
    tests running side by side never pick the same. Where that range leaves no room, the OS picks
    (`meshfit._runtime._ports.free_ports`).
    """
    start = _FIRST + _worker_index() * _BLOCK
    low = _ports.ephemeral_low()
    if low is None or start + _BLOCK > low // 2:
        return _ports.free_ports(count, host)
    ports: list[int] = []
    for _ in range(_BLOCK):  # each port of the block at most once a call: distinct
        port = start + next(_cursor) % _BLOCK
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"free_ports: fewer than {count} free ports in {start}..{start + _BLOCK - 1} on {host}")


def tf_config(ports: Sequence[int], index: int, task_type: str = "worker") -> str:
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                "MESHFIT_MIRRORED_RANK", "MESHFIT_RESTART_COUNT"):
        env.pop(key, None)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", "")}, **extra)
    return env


def start(args: Sequence[str], env: dict[str, str], cwd: str | None = None,
          fresh: bool = False) -> subprocess.Popen | _warm.WarmProcess:
    """Start ``python args...`` in its own session (so the whole group can be ended), output on a pipe.

    A script runs in a process forked from this pytest worker's warm interpreter (tests/_warm.py: torch
    and meshfit already imported, 4-5 s of CPU less a process); ``fresh=True``, a ``-m``/``-c`` command
    or an environment that changes what those imports read starts a new interpreter.
    """
    if not fresh and _warm.can_start(args, env):
        return _warm.start(args, env, cwd)
    return subprocess.Popen([sys.executable, *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen | _warm.WarmProcess, timeout: float) -> tuple[int, str]:
    """Wait for ``proc`` (killing its group after ``timeout``); its exit code and output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate(timeout=10)
        raise AssertionError(f"process {proc.args} timed out after {timeout}s; output:\n{out}") from None
    kill_group(proc)
    return proc.returncode, out


def exit_code_of(target: Callable[..., object], *args: object, timeout: float) -> int | None:
    """Run ``target(*args)`` in a new interpreter (multiprocessing's spawn); its exit code, the kill's after
    ``timeout`` seconds."""
    process = mp.get_context("spawn").Process(target=target, args=args)
    process.start()
    process.join(timeout=timeout)
    if process.is_alive():
        process.kill()
        process.join()
    return process.exitcode


def finish_survivor(survivor: subprocess.Popen | _warm.WarmProcess, victim: subprocess.Popen | _warm.WarmProcess,
                    timeout: float) -> tuple[int, str]:
    """``finish(survivor)``; then the victim's group is ended (a stopped one too) and reaped, whatever happened."""
    try:
        return finish(survivor, timeout=timeout)
    finally:
        kill_group(victim)
        finish(victim, timeout=30)


def kill_group(proc: subprocess.Popen | _warm.WarmProcess) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pids_carrying(variable: str, value: str) -> list[int]:
    """Live processes (zombies left out) whose environment holds ``variable=value``: a test marks the job
    it starts with a token of its own to find, after the job, what it left running."""
    marker = f"{variable}={value}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker not in f.read():
                    continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        found.append(int(pid))
    return found


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
