"""A worker's exit: garbage collected once, then the heap frozen (meshfit/_runtime/_exit_heap.py).

In this process, without starting one: `tests/test_exit.py` shows a real worker doing it after its
world's shutdown.
"""

from __future__ import annotations

import gc

import pytest

from meshfit._runtime import FREEZE_HEAP_AT_EXIT_ENV, freeze_heap_at_exit


class _Cycle:
    finalized: list[str] = []

    def __init__(self, name: str) -> None:
        self.name = name
        self.me = self  # unreachable only as a cycle: reference counting alone never frees it

    def __del__(self) -> None:
        _Cycle.finalized.append(self.name)


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # this process goes on: give the collector its objects back


def test_garbage_is_finalized_before_the_heap_is_frozen(monkeypatch, unfrozen):
    monkeypatch.delenv(FREEZE_HEAP_AT_EXIT_ENV, raising=False)
    gc.disable()  # no automatic collection may finalize it first
    try:
        _Cycle("garbage at exit")
        assert "garbage at exit" not in _Cycle.finalized
        assert freeze_heap_at_exit() is True
    finally:
        gc.enable()
    assert "garbage at exit" in _Cycle.finalized  # its finalizer ran, with the interpreter whole
    assert gc.get_freeze_count() > 0


@pytest.mark.parametrize("value", ["0", "off", "False"])
def test_the_environment_keeps_pythons_own_shutdown(monkeypatch, unfrozen, value):
    monkeypatch.setenv(FREEZE_HEAP_AT_EXIT_ENV, value)
    before = gc.get_freeze_count()
    assert freeze_heap_at_exit() is False
    assert gc.get_freeze_count() == before
