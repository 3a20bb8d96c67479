"""DCP's debug records that nothing shows are not built on meshfit's checkpoint writer."""

from __future__ import annotations

import logging

import pytest
import torch.distributed.checkpoint.logger as dcp_logger_module

from meshfit.train import _store


def _logger(name: str, level: int, handler: logging.Handler) -> logging.Logger:
    logger = logging.getLogger(name)
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False
    return logger


def test_torchs_default_dcp_logger_no_longer_builds_debug_records() -> None:
    logger = dcp_logger_module._dcp_logger  # torch sets it to DEBUG with a NullHandler (pytest adds its own later)
    assert not logger.isEnabledFor(logging.DEBUG)  # meshfit's import raised it to INFO
    assert logger.isEnabledFor(logging.ERROR)  # DCP's exception records still go where torch sends them


@pytest.mark.parametrize("handler", [logging.StreamHandler(), logging.NullHandler()], ids=["own-handler", "null"])
def test_a_logger_someone_configured_is_left_as_it_is(monkeypatch: pytest.MonkeyPatch,
                                                      handler: logging.Handler) -> None:
    logger = _logger(f"meshfit-test-dcp-{type(handler).__name__}", logging.DEBUG, handler)
    monkeypatch.setattr(dcp_logger_module, "_dcp_logger", logger)
    _store._drop_unseen_dcp_records()
    expected = logging.INFO if type(handler) is logging.NullHandler else logging.DEBUG
    assert logger.level == expected
    logger.propagate = True  # records that reach the root's handlers are seen: left at DEBUG
    logger.setLevel(logging.DEBUG)
    _store._drop_unseen_dcp_records()
    assert logger.level == logging.DEBUG
