"""Fully sharded data parallel on 4 gloo processes (issue 21): ``fit`` and the seed's custom loop on
``[("batch", 4)]`` equal one plain process, and a backup written mid-epoch by 4 processes resumes on
2, then on 1, and the model that run saves loads in a plain process.

The model, data and run are ``test_fully_sharded``'s: 20 steps of 8 examples an epoch, the last one of
5 (2, 1, 1, 1 examples on the 4 processes).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_fully_sharded import (
    BATCH,
    STEPS,
    _assert_custom_loop_equals_one_plain_process,
    _assert_weights_match,
    _data,
    _fit,
    _max_rel,
    _module,
    _scope,
)

from tests._multiproc import run_distributed


@pytest.fixture(scope="module")
def plain():
    return {name: run_distributed(_fit, world_size=1, args=(False, name, None, 2), timeout=300)[0]
            for name in ("sgd", "adam")}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_fit_on_four_sharded_processes_equals_one_plain_process(optimizer, plain):
    sharded = run_distributed(_fit, world_size=4, args=(True, optimizer, None, 2), timeout=400)
    want = plain[optimizer]
    for weights, losses, local, iterations, evaluated, _ in sharded:
        assert local == (8, 8)  # each process holds a quarter of the first weight's rows
        assert iterations == 2 * STEPS
        _assert_weights_match(weights, want[0], optimizer)
        np.testing.assert_allclose(losses, want[1], rtol=1e-5)
        np.testing.assert_allclose(evaluated, want[4], rtol=1e-5)
    for other in sharded[1:]:
        for a, b in zip(sharded[0][0], other[0], strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_seed_custom_loop_on_four_sharded_processes_equals_one_plain_process(optimizer):
    _assert_custom_loop_equals_one_plain_process(4, optimizer, timeout=400)


# ---- resharding a mid-epoch backup: 4 -> 2 -> 1 -> a plain process --------------------------------
class _Stop(Exception):
    pass


def _stage(rank, world, backup, stop_at, save_path):
    """Train SGD for 2 epochs with step backups every 5 steps; stop (raise) before step ``stop_at``."""
    import meshfit as mf

    class Interrupt(mf.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.trained = 0

        def on_train_batch_begin(self, batch, logs=None):
            if self.model.optimizer.iterations + 1 == stop_at:
                raise _Stop

        def on_train_batch_end(self, batch, logs=None):
            self.trained += 1

    with _scope(mf, world):
        model = mf.Model(_module())
        model.compile(optimizer=mf.optimizers.SGD(0.1),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data()
    interrupt = Interrupt()
    backup_cb = mf.callbacks.BackupAndRestore(backup, save_freq=5, delete_checkpoint=False, async_save=False)
    try:
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[backup_cb, interrupt])
    except _Stop:
        return {"stopped": True, "trained": interrupt.trained, "iterations": model.optimizer.iterations}
    if save_path:
        model.save(save_path)
    return {"stopped": False, "trained": interrupt.trained, "iterations": model.optimizer.iterations,
            "weights": model.get_weights()}


def test_a_mid_epoch_backup_from_four_processes_resumes_on_two_then_one_then_loads_plain(tmp_path):
    import meshfit as mf

    backup, saved = str(tmp_path / "backup"), str(tmp_path / "model.keras")
    uninterrupted = run_distributed(_stage, world_size=4, args=(str(tmp_path / "reference"), None, None),
                                    timeout=400)[0]
    assert uninterrupted["iterations"] == 2 * STEPS
    # 4 processes: stopped before step 13; the last backup holds step 10 (epoch 1, batch 10).
    four = run_distributed(_stage, world_size=4, args=(backup, 13, None), timeout=400)
    assert [r["stopped"] for r in four] == [True] * 4 and four[0]["trained"] == 12
    # 2 processes: resume at step 10 with the unseen batches 11..; stopped before step 28 (epoch 2).
    two = run_distributed(_stage, world_size=2, args=(backup, 28, None), timeout=400)
    assert [r["stopped"] for r in two] == [True] * 2
    assert two[0]["trained"] == 27 - 10  # steps 11..27: resumed at 10, not at an epoch start
    # 1 process (a one-device mesh): resume at step 25, train the last 15 steps, save the model.
    (one,) = run_distributed(_stage, world_size=1, args=(backup, None, saved), timeout=400)
    assert not one["stopped"] and one["trained"] == 2 * STEPS - 25 and one["iterations"] == 2 * STEPS
    assert _max_rel(one["weights"], uninterrupted["weights"]) <= 1e-5  # exactly the unseen examples
    loaded = mf.load_model(saved)  # this plain process: full weights gathered into the file
    assert [w.shape for w in loaded.get_weights()] == [(32, 8), (32,), (32, 32), (32,), (4, 32), (4,)]
    for got, want in zip(loaded.get_weights(), one["weights"], strict=True):
        np.testing.assert_array_equal(got, want)
    assert loaded.optimizer.iterations == 2 * STEPS
