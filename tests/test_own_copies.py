"""Seed 000's `write_filepath` dance on 2 workers: each rank saves to its own path, the chief's is kept."""

from __future__ import annotations

import os
import shutil

import numpy as np
import torch
from _multiproc import run_distributed
from _tutorial_paths import is_chief, write_filepath
from torch import nn

import meshfit as mf


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 4)).astype("float32"), rng.integers(0, 2, 64)


def _dance(rank: int, world: int, root: str) -> dict:
    strategy = mf.MultiWorkerMirroredStrategy()
    task_type, task_id = strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id
    x, y = _data()
    with strategy.scope():
        torch.manual_seed(0)
        model = mf.Model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
        model.compile(mf.optimizers.Adam(learning_rate=0.01),
                      mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)

    # model.save(write_model_path), then the non-chief's temp dir is removed
    model_path = os.path.join(root, "keras-model")
    write_model_path = write_filepath(model_path, task_type, task_id)
    model.save(write_model_path)
    if not is_chief(task_type, task_id):
        shutil.rmtree(os.path.dirname(write_model_path))

    # CheckpointManager(checkpoint, directory=write_checkpoint_dir), as the tutorial writes it
    checkpoint_dir = os.path.join(root, "ckpt")
    checkpoint = mf.train.Checkpoint(model=model.module, optimizer=model.optimizer)
    write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id)
    checkpoint_manager = mf.train.CheckpointManager(checkpoint, directory=write_checkpoint_dir, max_to_keep=1)
    checkpoint_manager.save()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    checkpoint_manager.save()  # max_to_keep=1: each rank prunes its own directory
    own_listing = sorted(os.listdir(write_checkpoint_dir))
    saved = model.get_weights()
    if not is_chief(task_type, task_id):
        shutil.rmtree(write_checkpoint_dir)

    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # move away from the saved state
    latest_checkpoint = mf.train.latest_checkpoint(checkpoint_dir)
    checkpoint.restore(latest_checkpoint)
    restored = model.get_weights()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # training continues from it
    return {"task": (task_type, task_id), "latest": latest_checkpoint, "own_listing": own_listing,
            "exact": all(np.array_equal(a, b) for a, b in zip(saved, restored, strict=True)),
            "after": model.get_weights()}


def test_the_tutorials_write_filepath_dance_with_checkpoint_manager(tmp_path):
    root = str(tmp_path)
    results = run_distributed(_dance, world_size=2, args=(root,), timeout=240)
    assert [r["task"] for r in results] == [("worker", 0), ("worker", 1)]
    chief_dir = os.path.join(root, "ckpt")
    assert results[0]["latest"] == results[1]["latest"] == os.path.join(chief_dir, "ckpt-2")
    assert results[0]["own_listing"] == results[1]["own_listing"] == ["checkpoint", "ckpt-2"]
    assert sorted(os.listdir(chief_dir)) == ["checkpoint", "ckpt-2"]  # the workers' temp dirs are gone
    assert all(r["exact"] for r in results)  # restored bitwise from the chief's directory
    for a, b in zip(results[0]["after"], results[1]["after"], strict=True):
        np.testing.assert_array_equal(a, b)  # and the replicas train on in sync

    # the chief's copies are whole: one process reads them
    # (the tutorial's rmtree of write_checkpoint_dir leaves worker 1's empty workertemp_1, as in TF)
    assert sorted(os.listdir(root)) == ["ckpt", "keras-model", "workertemp_1"]
    assert os.listdir(os.path.join(root, "workertemp_1")) == []
    loaded = mf.load_model(os.path.join(root, "keras-model"))
    assert len(loaded.get_weights()) == 4
    module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    mf.train.Checkpoint(model=module).restore(results[0]["latest"])
    assert torch.isfinite(module[0].weight).all()


def _per_rank_state_in_own_copies(rank: int, world: int, root: str) -> list[float]:
    noise = torch.full((2,), float(rank))
    checkpoint = mf.train.Checkpoint(noise=mf.train.PerRank(noise), step=torch.tensor(5))
    path = checkpoint.save(os.path.join(root, f"own{rank}", "ckpt-1"))
    noise.zero_()
    checkpoint.restore(os.path.join(root, "own0", "ckpt-1"))  # the chief's copy holds every rank's
    return [path, noise.tolist()]


def test_each_rank_copy_holds_every_ranks_per_rank_state(tmp_path):
    results = run_distributed(_per_rank_state_in_own_copies, world_size=2, args=(str(tmp_path),), timeout=180)
    assert results[0][1] == [0.0, 0.0] and results[1][1] == [1.0, 1.0]
    assert results[1][0] == str(tmp_path / "own1" / "ckpt-1")
    assert mf.train.latest_checkpoint(str(tmp_path / "own1")) == results[1][0]
