"""Sharded backups reshard on load: a (2, 2) backup continues on a (2,) mesh and on one process."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from tests._multiproc import run_distributed
from tests.dtensor._model_axis_mlp import mlp, model_axis_layouts

BATCH, STEPS_PER_EPOCH = 8, 10


def _data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2 * STEPS_PER_EPOCH * BATCH, 8)).astype("float32")
    y = rng.integers(0, 4, size=(2 * STEPS_PER_EPOCH * BATCH,)).astype("int64")
    return x, y


def _train(mesh_dims, backup_dir, epochs):
    from torch.distributed.tensor import DTensor

    import meshfit as mf

    module = mlp()
    scope = mf.get_strategy().scope()
    if mesh_dims:
        scope = model_axis_layouts(mf.dtensor.create_mesh(mesh_dims)).scope()
    with scope:
        model = mf.Model(module)
        model.compile(optimizer=mf.optimizers.Adam(0.01),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data()
    callbacks = [mf.callbacks.BackupAndRestore(backup_dir, delete_checkpoint=False)] if backup_dir else []
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, steps_per_epoch=STEPS_PER_EPOCH, shuffle=False,
                        verbose=0, callbacks=callbacks)
    weights = model.get_weights()
    state = next(iter(model.optimizer.torch_optimizer.state.values()))
    return (weights, model.optimizer.iterations, len(history.history["loss"]),
            type(state["exp_avg"]).__name__, isinstance(model.module[0].weight, DTensor))


def _on_mesh(rank, world, mesh_dims, backup_dir, epochs):
    return _train(mesh_dims, backup_dir, epochs)


def _close(a, b, tol=1e-5):
    return max(float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-12)) for x, y in zip(a, b, strict=True)) <= tol


@pytest.fixture(scope="module")
def backup(tmp_path_factory):
    """A backup written at the end of epoch 1 by 4 processes on a (2, 2) mesh."""
    directory = tmp_path_factory.mktemp("mesh") / "backup"
    results = run_distributed(_on_mesh, world_size=4, args=([("batch", 2), ("model", 2)], str(directory), 1),
                              timeout=300)
    assert all(r[1] == STEPS_PER_EPOCH and r[4] for r in results)
    return directory


@pytest.fixture(scope="module")
def uninterrupted():
    return _train(None, None, 2)[0]


def test_backup_from_2x2_continues_on_a_2_process_model_mesh(backup, uninterrupted, tmp_path):
    copy = tmp_path / "backup"
    shutil.copytree(backup, copy)
    results = run_distributed(_on_mesh, world_size=2, args=([("model", 2)], str(copy), 2), timeout=300)
    for weights, iterations, epochs_run, state_type, sharded in results:
        assert iterations == 2 * STEPS_PER_EPOCH and epochs_run == 2  # History restored with epoch 1, then epoch 2
        assert sharded and state_type == "DTensor"  # optimizer state resharded like its parameter
        assert _close(weights, uninterrupted)


def test_backup_from_2x2_continues_on_a_4_process_model_mesh(backup, uninterrupted, tmp_path):
    copy = tmp_path / "backup"
    shutil.copytree(backup, copy)
    results = run_distributed(_on_mesh, world_size=4, args=([("model", 4)], str(copy), 2), timeout=300)
    for weights, iterations, _, state_type, sharded in results:
        assert iterations == 2 * STEPS_PER_EPOCH and sharded and state_type == "DTensor"
        assert _close(weights, uninterrupted)


def test_backup_from_2x2_continues_on_one_process(backup, uninterrupted, tmp_path):
    copy = tmp_path / "backup"
    shutil.copytree(backup, copy)
    weights, iterations, epochs_run, state_type, sharded = _train(None, str(copy), 2)
    assert iterations == 2 * STEPS_PER_EPOCH and epochs_run == 2
    assert not sharded and state_type == "Tensor"
    assert _close(weights, uninterrupted)


def test_backup_from_2x2_continues_on_the_same_mesh(backup, uninterrupted, tmp_path):
    copy = tmp_path / "backup"
    shutil.copytree(backup, copy)
    results = run_distributed(_on_mesh, world_size=4, args=([("batch", 2), ("model", 2)], str(copy), 2),
                              timeout=300)
    for weights, iterations, epochs_run, state_type, _ in results:
        assert iterations == 2 * STEPS_PER_EPOCH and epochs_run == 2 and state_type == "DTensor"
        assert _close(weights, uninterrupted)


def _train_and_save(mesh_dims, path):
    import meshfit as mf

    module = mlp()
    mesh = mf.dtensor.create_mesh(mesh_dims)
    with model_axis_layouts(mesh).scope():
        model = mf.Model(module)
        model.compile(optimizer=mf.optimizers.Adam(0.01),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=STEPS_PER_EPOCH, shuffle=False, verbose=0)
    model.save(path)  # every process calls it; the files hold full tensors
    return model.get_weights()


def _load_on_model_mesh(rank, world, path):
    from torch.distributed.tensor import DTensor

    import meshfit as mf

    mesh = mf.dtensor.create_mesh([("model", 2)])
    with model_axis_layouts(mesh).scope():
        model = mf.load_model(path)
    first = model.module[0].weight
    state = model.optimizer.torch_optimizer.state[first]
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=2, shuffle=False, verbose=0)
    return (isinstance(first, DTensor), tuple(first.to_local().shape), first.layout.to_string(),
            type(state["exp_avg"]).__name__, model.optimizer.iterations)


def test_model_save_writes_full_tensors_and_load_model_reshards_them(tmp_path):
    import safetensors.torch

    path = str(tmp_path / "saved")
    saved = run_distributed(_save_on_2x2, world_size=4, args=(path,), timeout=300)[0]
    plain = safetensors.torch.load_file(str(tmp_path / "saved" / "model.safetensors"))  # plain torch reads it
    plain = [plain[key] for key in ("0.weight", "0.bias", "2.weight", "2.bias")]
    assert [tuple(t.shape) for t in plain] == [(16, 8), (16,), (4, 16), (4,)]
    for tensor, weight in zip(plain, saved, strict=True):
        np.testing.assert_array_equal(tensor.numpy(), weight)
    for is_dtensor, local_shape, layout, state_type, iterations in run_distributed(
            _load_on_model_mesh, world_size=2, args=(path,), timeout=300):
        assert is_dtensor and local_shape == (8, 8) and layout == "sharding_specs:model,unsharded, mesh:|model=2|cpu"
        assert state_type == "DTensor" and iterations == STEPS_PER_EPOCH + 2  # saved optimizer state, resharded
    import meshfit as mf

    alone = mf.load_model(path)  # one plain process
    for got, weight in zip(alone.get_weights(), saved, strict=True):
        np.testing.assert_array_equal(got, weight)


def _save_on_2x2(rank, world, path):
    return _train_and_save([("batch", 2), ("model", 2)], path)


def _async_save_sharded_twice(rank, world, directory):
    import meshfit as mf
    from meshfit.train import Checkpoint, CheckpointManager

    mesh = mf.dtensor.create_mesh([("model", 2)])
    weight = mf.dtensor.copy_to_mesh(torch.arange(16.0).reshape(4, 4), mf.dtensor.Layout(["model", "unsharded"], mesh))
    manager = CheckpointManager(Checkpoint(w=weight), directory)
    snapshots = []
    for _ in range(2):  # the second save re-stages into the first's buffers
        future = manager.save(async_save=True)
        snapshots.append(weight.full_tensor().clone())
        with torch.no_grad():
            weight.add_(100.0)  # training goes on while the write runs: the staged copy is written
        future.result(timeout=60)
    restored = []
    for path in manager.checkpoints:
        Checkpoint(w=weight).restore(path)
        restored.append(weight.full_tensor().clone())
    return [torch.equal(a, b) for a, b in zip(snapshots, restored, strict=True)], type(weight).__name__


def test_async_saves_of_a_sharded_tensor_write_each_staged_snapshot(tmp_path):
    for equal, kind in run_distributed(_async_save_sharded_twice, world_size=2, args=(str(tmp_path),), timeout=150):
        assert kind == "DTensor" and equal == [True, True]
