"""The suite marks a test ``slow`` when it starts processes (tests/conftest.py), also through a shared helper
of tests/ (``_procs``, ``_multiproc``...): the quick run (``make test-quick``) starts none and refuses one.

The functions below are never called: the conftest reads their source.
"""

from __future__ import annotations

import contextlib
import sys

import _procs
from _procs import exit_code_of


def _exit_17() -> None:
    raise SystemExit(17)


def _calls_an_imported_process_helper() -> None:
    exit_code_of(_exit_17, timeout=60)


def _calls_a_process_helper_of_an_imported_module() -> None:
    _procs.exit_code_of(_exit_17, timeout=60)


def _calls_a_helper_that_does() -> None:
    _calls_an_imported_process_helper()


def _starts_nothing() -> object:
    return _procs.kill_group  # named, not called


@contextlib.contextmanager
def _starting_a_process():
    yield exit_code_of(_exit_17, timeout=60)


@contextlib.contextmanager
def _quiet():
    yield None


def _starters() -> set[str]:
    conftest = sys.modules["conftest"]
    return conftest._process_starters(sys.modules[__name__])


def test_a_function_calling_an_imported_process_helper_starts_processes():
    starters = _starters()
    assert {"_calls_an_imported_process_helper", "_calls_a_process_helper_of_an_imported_module",
            "_calls_a_helper_that_does", "exit_code_of"} <= starters, starters
    assert "_starts_nothing" not in starters and "_exit_17" not in starters, starters


def test_each_context_manager_is_read_from_its_own_source():
    # Every @contextmanager function wraps its generator in one code object of contextlib's.
    starters = _starters()
    assert "_starting_a_process" in starters and "_quiet" not in starters, starters
