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
# run_distributed, scripts, meshfit launch) directly or through a helper (of its module, or one it imports
# from another module of tests/, such as tests/_procs.py), or is marked.
_STARTS_PROCESSES = re.compile(r"\b(run_distributed|start|subprocess\.\w+|Popen|spawn_local_replicas|"
                               r"_cli\.main|launch_main)\(")


def _tests_module(name: str) -> object | None:
    """The loaded module called ``name`` when its file is in tests/, else None."""
    module = sys.modules.get(name or "")
    return module if module is not None and (getattr(module, "__file__", None) or "").startswith(TESTS) else None


_STARTERS: dict[str, set[str]] = {}  # per module name, once per session: collection asks per test item


def _process_starters(module: object) -> set[str]:
    """Names of the module's functions that start processes, directly or through each other; a function it
    imports from another tests/ module counts as it does in its own module, and so does ``helpers.name``
    for a tests/ module it imports as ``helpers``."""
    name = getattr(module, "__name__", "")
    if name in _STARTERS:
        return _STARTERS[name]
    _STARTERS[name] = set()  # two helper modules importing each other: the inner look-up sees none yet
    functions: dict[str, str] = {}
    starters: set[str] = set()
    for key, value in vars(module).items():
        if inspect.ismodule(value) and (helpers := _tests_module(value.__name__)) is not None:
            starters |= {f"{key}.{s}" for s in _process_starters(helpers) if "." not in s}  # `_procs.start(`
        if not inspect.isfunction(value):
            continue
        if value.__module__ == name:
            functions[key] = _source(value)
        elif (home := _tests_module(value.__module__)) is not None and value.__name__ in _process_starters(home):
            starters.add(key)
    starters |= {key for key, source in functions.items() if _STARTS_PROCESSES.search(source)}
    while True:
        more = {key for key, source in functions.items() if key not in starters
                and any(re.search(rf"\b{re.escape(s)}\(", source) for s in starters)}
        if not more:
            break
        starters |= more
    _STARTERS[name] = starters
    return starters


_SOURCES: dict[object, str] = {}


def _source(function: object) -> str:
    """The function's source, read once per code object (collection asks for it per test item)."""
    # Keyed by the code of the function itself: every @contextmanager function is a wrapper sharing
    # contextlib's one code object, and inspect.getsource reads through the wrapper.
    key = getattr(inspect.unwrap(function), "__code__", function)
    if key not in _SOURCES:
        try:
            _SOURCES[key] = inspect.getsource(function)  # type: ignore[arg-type]
        except (OSError, TypeError):
            _SOURCES[key] = ""
    return _SOURCES[key]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist turns the xdist_group marks added here into groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def starts_processes(function: object) -> bool:
        """``function`` starts processes itself or through a process-starting function of its module."""
        module = _tests_module(getattr(function, "__module__", "") or "")
        if module is None:
            return False  # pytest's own fixtures (tmp_path, capsys...) start nothing
        names = _process_starters(module)
        source = _source(function)
        return (getattr(function, "__name__", None) in names or bool(_STARTS_PROCESSES.search(source))
                or any(re.search(rf"\b{re.escape(s)}\(", source) for s in names))

    for item in items:
        function = getattr(item, "function", None)
        if function is None:
            continue
        # The test's own body, or any fixture it uses (directly or through other fixtures).
        fixtures = getattr(item, "_fixtureinfo", None)
        definitions = [definition for defs in (fixtures.name2fixturedefs.values() if fixtures else ()) for definition in defs]
        if starts_processes(function) or any(starts_processes(d.func) for d in definitions):
            item.add_marker(pytest.mark.slow)
        # `make test` runs tests in several pytest workers (pytest-xdist, --dist loadgroup): the tests sharing
        # a module-scoped fixture that starts processes run in one worker, which starts them once.
        shared = [d for d in definitions if d.scope in ("module", "class", "package", "session")
                  and starts_processes(d.func)]
        if item.get_closest_marker("crowded") is not None:
            # Four processes of a 2x2 mesh wait on each other at every collective: beside another such
            # test on 2 cores one ran 15x slower than alone (96-111 s against 6 s). The crowded tests
            # take turns in one worker (a whole module when it is marked, so its shared fixtures too).
            item.add_marker(pytest.mark.xdist_group("crowded"))
        elif shared:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__ if item.module else item.nodeid))
    # The longest first (a declared timeout above the default, then the process-starting ones), so that the
    # workers end together on short tests instead of waiting for one long test started last. Stable: a
    # module's tests keep their order.
    default = float(config.getini("timeout") or 0)

    def weight(item: pytest.Item) -> tuple[float, bool]:
        marker = item.get_closest_marker("timeout")
        declared = float(marker.args[0]) if marker is not None and marker.args else default
        return -max(declared - default, 0.0), item.get_closest_marker("slow") is None

    items.sort(key=weight)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    """``kill <pytest>`` (a CI timeout, a developer) ends the run as Ctrl-C does: the running test's
    ``finally`` blocks and every fixture's teardown still end the processes they started."""
    import signal

    signal.signal(signal.SIGTERM, _interrupted)


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


class _StartedAProcess(RuntimeError):
    pass


@pytest.fixture(autouse=True)
def _quick_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """A test not marked ``slow`` runs in ``make test-quick``, which starts no process: refuse one.

    Every way Python starts a process ends in ``os.fork``, ``os.posix_spawn`` or
    ``_posixsubprocess.fork_exec`` (subprocess keeps its own name for it; multiprocessing's fork,
    spawn and forkserver use these).
    """
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    import _posixsubprocess
    import subprocess

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise _StartedAProcess(f"{request.node.nodeid} starts a process but is not marked slow: "
                               "mark it @pytest.mark.slow (make test-quick starts no process)")

    for owner, name in ((os, "fork"), (os, "posix_spawn"), (os, "posix_spawnp"), (_posixsubprocess, "fork_exec"),
                        (subprocess, "_fork_exec")):
        monkeypatch.setattr(owner, name, refuse)
    yield


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest):
    import time

    # A test not marked slow cannot start a process (`_quick_tests_start_no_process`): scanning /proc
    # for its children (2 scans of 3-5 ms each, for ~2,100 tests) would find none.
    may_start = request.node.get_closest_marker("slow") is not None
    env_before = dict(os.environ)
    kids_before = _children(os.getpid()) if may_start else set()
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
    leaked = _children(os.getpid()) - kids_before - helper_pids() if may_start else set()
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
