"""Batch normalization on several workers: running statistics agree after fit, and are saved from rank 0."""

from __future__ import annotations

import os

import numpy as np
import torch
from _multiproc import run_distributed
from torch import nn

import meshfit as mf
from meshfit.train import Checkpoint, PerRank


def _bn_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))


def _fit_then_save(rank: int, world: int, root: str) -> dict:
    strategy = mf.MultiWorkerMirroredStrategy()
    (x, y), _ = mf.datasets.load_digits()
    dataset = mf.data.Dataset.from_tensor_slices((x[:256], y[:256])).shuffle(256, seed=3).batch(32)
    with strategy.scope():
        model = mf.Model(_bn_mlp())
        model.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(dataset, epochs=1, steps_per_epoch=5, verbose=0)  # ends inside the pass
    # A Checkpoint of the module after fit: refused today if the statistics differed between ranks.
    path = Checkpoint(model=model.module).save(os.path.join(root, "after-fit"))
    return {"weights": model.get_weights(), "saved": path}


def test_after_fit_every_worker_holds_rank_0s_running_statistics_and_a_checkpoint_saves(tmp_path):
    r0, r1 = run_distributed(_fit_then_save, world_size=2, args=(str(tmp_path),), timeout=180)
    assert r0["saved"] == r1["saved"]
    names = list(_bn_mlp().state_dict())
    for name, a, b in zip(names, r0["weights"], r1["weights"], strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)  # buffers (running_mean/var) included
    assert any("running_mean" in n for n in names)


def _save_differing_buffers(rank: int, world: int, root: str) -> list[float]:
    norm = nn.BatchNorm1d(3)
    norm.running_mean.fill_(float(rank + 1))  # 1 on rank 0, 2 on rank 1: DDP's state after a step
    # Rank 0's plan is bigger (a larger per-rank tensor listed first), so DCP's size-balancing
    # deduplication alone would write the shared buffer from rank 1.
    extra = PerRank(torch.zeros(10_000 if rank == 0 else 1))
    Checkpoint(extra=extra, norm=norm).save(os.path.join(root, "ckpt"))
    fresh = nn.BatchNorm1d(3)
    Checkpoint(extra=PerRank(torch.zeros(10_000 if rank == 0 else 1)), norm=fresh).restore(os.path.join(root, "ckpt"))
    return fresh.running_mean.tolist()


def test_buffers_that_differ_between_ranks_are_saved_from_rank_0(tmp_path):
    restored = run_distributed(_save_differing_buffers, world_size=2, args=(str(tmp_path),), timeout=150)
    assert restored == [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]  # rank 0's copy, the one DDP trains with


def _fit_digits(strategy: mf.distribute.Strategy, norm: type) -> list[np.ndarray]:
    (x, y), _ = mf.datasets.load_digits()
    dataset = mf.data.Dataset.from_tensor_slices((x[:256], y[:256])).shuffle(256, seed=3).batch(32)
    with strategy.scope():
        torch.manual_seed(0)
        module = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), norm(16), nn.ReLU(), nn.Linear(16, 10))
        model = mf.Model(module)
        model.compile(mf.optimizers.SGD(learning_rate=0.1), mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(dataset, epochs=2, verbose=0)
    return model.get_weights()


def _fit_synchronized(rank: int, world: int) -> list[np.ndarray]:
    return _fit_digits(mf.MultiWorkerMirroredStrategy(), mf.nn.SyncBatchNorm)


def test_sync_batch_norm_on_two_gloo_workers_trains_as_batch_norm_on_the_global_batch():
    single = _fit_digits(mf.OneDeviceStrategy("cpu"), nn.BatchNorm1d)
    w0, w1 = run_distributed(_fit_synchronized, world_size=2, timeout=180)
    names = list(nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.BatchNorm1d(16)).state_dict()) + ["4.weight",
                                                                                                     "4.bias"]
    for name, a, b, s in zip(names, w0, w1, single, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
        np.testing.assert_allclose(a, s, rtol=1e-4, atol=1e-5, err_msg=name)  # statistics of the global batch


def test_sync_batch_norm_in_one_process_is_batch_norm():
    torch.manual_seed(0)
    x = torch.randn(8, 3, 5)
    plain, synced = nn.BatchNorm1d(3), mf.nn.SyncBatchNorm(3)
    torch.testing.assert_close(synced(x), plain(x))
    torch.testing.assert_close(synced.running_var, plain.running_var)
    converted = mf.nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Conv1d(3, 3, 1), nn.BatchNorm1d(3)))
    assert isinstance(converted[1], mf.nn.SyncBatchNorm)
