"""2-D checkpoints stay sharded (DCP) and reshard on load: a mid-epoch backup written by a (2, 2) mesh
resumes on (1, 4), then (4, 1), then (1, 2), then in a plain process, whose run ends equal to one plain
process that was never interrupted; the model that run saves (``model.save``) loads in a plain process.

The model and data are ``_two_d_model``'s: 20 steps of 8 sequences an epoch, the last one of 5.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from _two_d_model import BATCH, STEPS, data, max_rel, module, scope

from tests._multiproc import run_distributed

# 4 gloo processes a run, several runs a test, on a shared 2-core machine
pytestmark = pytest.mark.timeout(1200)


class _Stop(Exception):
    pass


def _stage(rank, world, shape, backup, stop_at, save_path):
    """Train SGD for 2 epochs with step backups every 5 steps; stop (raise) before step ``stop_at``."""
    import meshfit as mf

    class Interrupt(mf.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.trained = 0

        def on_train_batch_begin(self, batch, logs=None):
            if stop_at is not None and self.model.optimizer.iterations + 1 == stop_at:
                raise _Stop

        def on_train_batch_end(self, batch, logs=None):
            self.trained += 1

    with scope(mf, shape):
        model = mf.Model(module())
        model.compile(optimizer=mf.optimizers.SGD(0.1),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data()
    interrupt = Interrupt()
    callbacks = [interrupt]
    if backup:
        callbacks.insert(0, mf.callbacks.BackupAndRestore(backup, save_freq=5, delete_checkpoint=False,
                                                          async_save=False))
    try:
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    except _Stop:
        return {"stopped": True, "trained": interrupt.trained}
    if save_path:
        model.save(save_path)
    return {"stopped": False, "trained": interrupt.trained, "iterations": model.optimizer.iterations,
            "weights": model.get_weights()}


def test_a_two_by_two_backup_reshards_onto_one_by_four_four_by_one_one_by_two_and_a_plain_process(tmp_path):
    import meshfit as mf

    backup, saved = str(tmp_path / "backup"), str(tmp_path / "model.keras")
    (uninterrupted,) = run_distributed(_stage, world_size=1, args=(None, None, None, None), timeout=300)
    assert uninterrupted["iterations"] == 2 * STEPS
    # (2, 2): stopped before step 8; the last backup holds step 5, written as DCP shards by 4 processes.
    four = run_distributed(_stage, world_size=4, args=((2, 2), backup, 8, None), timeout=400)
    assert [r["stopped"] for r in four] == [True] * 4 and four[0]["trained"] == 7
    shards = sorted(f for f in os.listdir(os.path.join(backup, "ckpt-1")) if f.endswith(".distcp"))
    assert shards == [f"__{r}_0.distcp" for r in range(4)]
    # (1, 4): resumed at step 5 (not at the epoch start), stopped before 13.
    one_by_four = run_distributed(_stage, world_size=4, args=((1, 4), backup, 13, None), timeout=400)
    assert one_by_four[0]["stopped"] and one_by_four[0]["trained"] == 12 - 5
    # (4, 1): resumed at step 10, stopped before 23 (into epoch 2).
    four_by_one = run_distributed(_stage, world_size=4, args=((4, 1), backup, 23, None), timeout=400)
    assert four_by_one[0]["stopped"] and four_by_one[0]["trained"] == 22 - 10
    # (1, 2): resumed at step 20, stopped before 28.
    one_by_two = run_distributed(_stage, world_size=2, args=((1, 2), backup, 28, None), timeout=400)
    assert one_by_two[0]["stopped"] and one_by_two[0]["trained"] == 27 - 20
    # a plain process: resumed at step 25, trains the last 15 steps and saves the model.
    (plain,) = run_distributed(_stage, world_size=1, args=(None, backup, None, saved), timeout=300)
    assert not plain["stopped"] and plain["trained"] == 2 * STEPS - 25 and plain["iterations"] == 2 * STEPS
    assert max_rel(plain["weights"], uninterrupted["weights"]) <= 1e-5  # exactly the unseen batches, once
    loaded = mf.load_model(saved, module=module())  # a custom module: its code, the file's weights
    for got, want in zip(loaded.get_weights(), plain["weights"], strict=True):
        np.testing.assert_array_equal(got, want)


def _save_on_two_by_two(rank, world, path):
    import meshfit as mf

    with scope(mf, (2, 2)):
        model = mf.Model(module())
        model.compile(optimizer=mf.optimizers.AdamW(1e-3),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data(21)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model.save(path)
    return model.get_weights()


def test_model_save_on_two_by_two_writes_full_tensors_torch_reads(tmp_path):
    import zipfile

    import torch

    import meshfit as mf

    path = str(tmp_path / "model.keras")
    weights = run_distributed(_save_on_two_by_two, world_size=4, args=(path,), timeout=400)[0]
    loaded = mf.load_model(path, module=module())
    assert [w.shape for w in loaded.get_weights()] == [w.shape for w in weights]
    for got, want in zip(loaded.get_weights(), weights, strict=True):
        np.testing.assert_array_equal(got, want)
    state = loaded.module.state_dict()
    assert type(state["layers.0.attn.qkv.weight"]) is torch.Tensor  # a plain, full tensor
    assert tuple(state["layers.0.attn.qkv.weight"].shape) == (48, 16)
    assert zipfile.is_zipfile(path)
