"""Shared by the GPU tests: the marks that skip them without CUDA, a small model and its data."""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf

REASON = "needs a CUDA GPU: run `make gpu-check` on a machine with one"
MARKS = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=REASON)]


def data(n: int = 256, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    return x, (x[:, :2].sum(axis=1) > 0).astype("int64") + 2 * (x[:, 2] > 0).astype("int64")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def compiled_model(module: nn.Module | None = None, optimizer: Any = None) -> mf.Model:
    model = mf.Model(module if module is not None else mlp())
    model.compile(optimizer or mf.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                  mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def _child(fn: Callable[[], Any], results: mp.Queue) -> None:
    try:
        results.put(("ok", fn()))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def in_fresh_process(fn: Callable[[], Any], timeout: float = 240.0) -> Any:
    """``fn()`` in a new (spawned) process with no process group: its result, or its error re-raised."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, results), daemon=True)
    proc.start()
    try:
        status, value = results.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"in_fresh_process: no result within {timeout}s") from None
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if status != "ok":
        raise RuntimeError(f"the child process failed:\n{value}")
    return value
