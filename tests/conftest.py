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
    starters: dict[str, set[str]] = {}

    def starts_processes(function: object) -> bool:
        """``function`` starts processes itself or through a process-starting function of its module."""
        module = sys.modules.get(getattr(function, "__module__", "") or "")
        if module is None or not (getattr(module, "__file__", None) or "").startswith(TESTS):
            return False  # pytest's own fixtures (tmp_path, capsys...) start nothing
        names = starters.setdefault(module.__name__, _process_starters(module))
        source = _source(function)
        return (getattr(function, "__name__", None) in names or bool(_STARTS_PROCESSES.search(source))
                or any(re.search(rf"\b{re.escape(s)}\(", source) for s in names))

    for item in items:
        function = getattr(item, "function", None)
        if function is None:
            continue
        # The test's own body, or any fixture it uses (directly or through other fixtures).
        fixtures = getattr(item, "_fixtureinfo", None)
        fixture_functions = [definition.func for definitions in (fixtures.name2fixturedefs.values() if fixtures else ())
                             for definition in definitions]
        if starts_processes(function) or any(starts_processes(f) for f in fixture_functions):
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


# multiprocessing's fork server (run_distributed's ranks fork from it) and resource tracker live for the
# whole session once started: no test's leak. Nothing starts them here: `make test-quick` starts no process.
from _multiproc import helper_pids  # noqa: E402

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
    leaked = _children(os.getpid()) - kids_before - helper_pids()
    while leaked and time.monotonic() < deadline:
        time.sleep(0.1)
        leaked = _children(os.getpid()) - kids_before - helper_pids()
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
