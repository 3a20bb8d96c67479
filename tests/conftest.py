"""Autouse guards: a test must not leak env vars, process groups or child processes."""

from __future__ import annotations

import inspect
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

# `make test-quick` runs `-m "not slow"`: a test is slow when it starts processes (gloo groups through
# run_distributed, scripts, meshfit launch) directly or through a helper of its module, or is marked.
_STARTS_PROCESSES = re.compile(r"\b(run_distributed|start|subprocess\.\w+|Popen|spawn_local_replicas|"
                               r"_cli\.main|launch_main)\(")


def _process_starters(module: object) -> set[str]:
    """Names of the module's functions that start processes, directly or through each other."""
    functions = {name: _source(value) for name, value in vars(module).items()
                 if inspect.isfunction(value) and value.__module__ == getattr(module, "__name__", None)}
    starters = {name for name, source in functions.items() if _STARTS_PROCESSES.search(source)}
    while True:
        more = {name for name, source in functions.items() if name not in starters
                and any(re.search(rf"\b{re.escape(s)}\(", source) for s in starters)}
        if not more:
            return starters
        starters |= more


def _source(function: object) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    starters: dict[int, set[str]] = {}
    for item in items:
        function, module = getattr(item, "function", None), getattr(item, "module", None)
        if function is None or module is None:
            continue
        names = starters.setdefault(id(module), _process_starters(module))
        if function.__name__ in names:
            item.add_marker(pytest.mark.slow)


def _children(pid: int) -> set[int]:
    """Live descendants of ``pid`` (Linux /proc), excluding zombies."""
    kids: set[int] = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return kids
    parents: dict[int, int] = {}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    frontier = [pid]
    while frontier:
        p = frontier.pop()
        for child, parent in parents.items():
            if parent == p and child not in kids:
                kids.add(child)
                frontier.append(child)
    return kids


# multiprocessing's resource tracker lives for the whole session: start it before any guard looks.
from multiprocessing import resource_tracker  # noqa: E402

resource_tracker.ensure_running()


# Set by pytest itself, or by torch on first use of inductor-backed ops: not the test's doing.
_ENV_SET_BY_TOOLS = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"}


@pytest.fixture(autouse=True)
def _no_leaks():
    import time

    env_before = dict(os.environ)
    kids_before = _children(os.getpid())
    yield
    import torch.distributed as dist

    leaked_pg = dist.is_available() and dist.is_initialized()
    if leaked_pg:
        dist.destroy_process_group()
    env_after = dict(os.environ)
    changed = {k for k in set(env_before) | set(env_after)
               if env_before.get(k) != env_after.get(k) and k not in _ENV_SET_BY_TOOLS}
    os.environ.clear()
    os.environ.update(env_before)
    deadline = time.monotonic() + 5
    leaked = _children(os.getpid()) - kids_before
    while leaked and time.monotonic() < deadline:
        time.sleep(0.1)
        leaked = _children(os.getpid()) - kids_before
    for pid in leaked:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    problems = []
    if leaked_pg:
        problems.append("a process group was left initialized")
    if changed:
        problems.append(f"environment variables changed: {sorted(changed)}")
    if leaked:
        problems.append(f"child processes left running: {sorted(leaked)}")
    if problems:
        pytest.fail("test leaked: " + "; ".join(problems))
