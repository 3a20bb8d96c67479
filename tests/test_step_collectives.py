"""Per step, fit on 2 workers makes no control collective beyond one per execution (the agreed
stop/preemption flags), when no callback reads per-batch logs. Gradients travel inside DDP's
reducer (the device plane) and are not counted here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _collectives import count_collectives
from _multiproc import run_distributed
from torch import nn

import meshfit as mf


class _Counter(mf.callbacks.Callback):
    reads_batch_logs = False  # like a progress bar off: nobody reads per-batch logs

    def __init__(self, counts: list[int]) -> None:
        super().__init__()
        self.counts, self.at_begin, self.per_execution = counts, 0, []

    def on_train_batch_begin(self, batch, logs=None):
        self.at_begin = self.counts[0]

    def on_train_batch_end(self, batch, logs=None):
        self.per_execution.append(self.counts[0] - self.at_begin)


def _worker(rank: int, size: int, steps_per_execution: int) -> list[int]:
    counts = count_collectives()  # DDP's gradient buckets (the device plane) not counted
    strategy = mf.MultiWorkerMirroredStrategy()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype("float32"), rng.integers(0, 3, size=64)
    with strategy.scope():
        torch.manual_seed(0)
        model = mf.Model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
        model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], steps_per_execution=steps_per_execution)
    counter = _Counter(counts)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[counter])
    return counter.per_execution


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_fit_makes_one_control_collective_per_execution(steps_per_execution):
    results = run_distributed(_worker, world_size=2, args=(steps_per_execution,), timeout=180)
    for per_execution in results:
        assert len(per_execution) == 8 // steps_per_execution
        # The first execution may set up (DDP's first forward); the second forward agrees, once, whether
        # DDP must look for unused parameters (one more collective, in the second execution when each
        # execution is one step). After that, exactly the one reduction of the agreed flags per
        # execution, whatever the number of steps in it.
        setup = 2 if steps_per_execution == 1 else 1
        if steps_per_execution == 1:
            assert per_execution[1] == 2, per_execution
        assert per_execution[setup:] == [1] * (len(per_execution) - setup), per_execution
