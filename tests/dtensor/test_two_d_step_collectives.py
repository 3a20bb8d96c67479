"""The collectives of a 2-D ``fit`` step outside the model: one all-reduce over the world for its logs.

On 4 gloo processes, mesh ``[("batch", 2), ("model", 2)]`` with the guide's map (the small transformer LM),
a callback reading per-batch logs: each step's loss and metric states go to every process in one
all-reduce over the whole world (the hand-written loop does none; the logs need one), not one per mesh
axis. The logs stay those of the global batch on every process, and a stop asked for on a process at
``model`` coordinate 1 still stops every process at the same step.
"""

from __future__ import annotations

import numpy as np
import pytest
from _two_d_model import BATCH, data, module, optimizer, scope

from tests._multiproc import run_distributed

pytestmark = pytest.mark.timeout(600)

STEPS = 4


def _fit(rank, world, shape, stop_rank=None):
    import torch.distributed as dist

    import meshfit as mf

    with scope(mf, shape):
        model = mf.Model(module())
        model.compile(optimizer=optimizer(mf, "sgd"), loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["sparse_categorical_accuracy"])
    x, y = data(BATCH * STEPS)
    calls: list[int] = []  # the size of each all-reduce's group, made through torch.distributed
    original = dist.all_reduce

    def counted(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append(dist.get_world_size(group))
        return original(tensor, op=op, group=group, async_op=async_op)

    per_step: list[list[int]] = []
    logs_seen: list[dict] = []

    class Reader(mf.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            calls.clear()

        def on_train_batch_end(self, batch, logs=None):
            per_step.append(list(calls))
            logs_seen.append(dict(logs))
            if rank == stop_rank and batch == 1:
                self.model.stop_training = True

    dist.all_reduce = counted
    try:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[Reader()])
    finally:
        dist.all_reduce = original
    return per_step, logs_seen, model.optimizer.iterations


def _plain_logs():
    return run_distributed(_fit, world_size=1, args=(None,), timeout=300)[0][1]


def test_a_two_by_two_step_reduces_its_logs_in_one_all_reduce_over_the_world():
    want = _plain_logs()
    results = run_distributed(_fit, world_size=4, args=((2, 2),), timeout=400)
    for per_step, logs, iterations in results:
        assert iterations == STEPS
        # the old path took two: a sum over ``batch`` (2 processes), then a max over ``model`` (2)
        assert per_step == [[4]] * STEPS, per_step
        for got, expected in zip(logs, want, strict=True):
            assert got.keys() == expected.keys()
            for name in got:
                np.testing.assert_allclose(got[name], expected[name], rtol=1e-5)
    for _, logs, _ in results[1:]:
        assert logs == results[0][1]  # every process logs the same numbers, bitwise


@pytest.mark.parametrize("stop_rank", [1, 3])  # (batch 0, model 1) and (batch 1, model 1)
def test_a_stop_asked_for_on_a_model_axis_process_stops_every_process_at_the_same_step(stop_rank):
    results = run_distributed(_fit, world_size=4, args=((2, 2), stop_rank), timeout=400)
    # asked for in step 1's on_train_batch_end: the flag rides in step 2's reduction, every process stops there
    assert [iterations for *_, iterations in results] == [3] * 4
    assert [len(per_step) for per_step, *_ in results] == [3] * 4
