"""Start worker scripts as real processes for tests: free ports, timeouts, nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from meshfit._runtime._supervisor import free_ports  # noqa: F401  (re-exported for the tests)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def start(args: Sequence[str], env: dict[str, str], cwd: str | None = None) -> subprocess.Popen:
    """Start ``python args...`` in its own session (so the whole group can be ended)."""
    return subprocess.Popen([sys.executable, *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """Wait for ``proc`` (killing its group after ``timeout``); its exit code and output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate(timeout=10)
        raise AssertionError(f"process {proc.args} timed out after {timeout}s; output:\n{out}") from None
    kill_group(proc)
    return proc.returncode, out


def kill_group(proc: subprocess.Popen) -> None:
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


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
