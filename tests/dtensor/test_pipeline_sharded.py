"""Pipeline stages fully sharded over the data axis, and what a process keeps of the model.

``LayoutMap.fully_sharded(mesh).pipeline(...)`` on a ``pipe`` × ``batch`` mesh: each stage's parameters
go through torch's ``fully_shard`` over ``batch`` (as torchtitan applies FSDP to each stage), and torch's
schedule reduce-scatters the microbatches' gradients once per step. It must give one plain process's
weights and logs on the same global batch (a last, smaller batch included), save and back up what one
plain process loads, and keep on each process a quarter of one process's parameters, gradients and
optimizer state on 2 stages × 2 shards (half on 2 replicated stages: another stage's parameters are
released, their shapes kept).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from _multiproc import run_distributed
from _pipeline_model import Classifier
from _pipeline_run import _data, _model, _one_process, _pipeline
from torch import nn

TIMEOUT = 300


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(("schedule", "split_points", "stages_per_rank", "mesh_dims"), [
    ("1F1B", ["blocks.2"], 1, (("pipe", 2), ("batch", 2))),
    ("Interleaved1F1B", ["blocks.1", "blocks.2", "blocks.3"], 2, (("batch", 2), ("pipe", 2))),
])
def test_fully_sharded_stages_equal_one_process(tmp_path: Any, schedule: str, split_points: list[str],
                                                stages_per_rank: int, mesh_dims: tuple) -> None:
    """2 stages (or 4, interleaved) × 2 shards on 4 processes, 56 rows by 16 (the last batch 8: 4 a replica)."""
    import meshfit as mf

    weights, history, _ = _one_process(56)
    results = run_distributed(_pipeline, world_size=4, timeout=TIMEOUT - 60,
                              args=(str(tmp_path), schedule, split_points, stages_per_rank, mesh_dims, 56, 2, True))
    held = set()
    for result in results:
        for name in ("loss", "accuracy"):
            np.testing.assert_allclose(result["history"][name], history[name], rtol=1e-5, err_msg=name)
        for path, value in result["stage"].items():  # this stage's shards, gathered
            np.testing.assert_allclose(value, weights[path], rtol=1e-5, atol=1e-6, err_msg=path)
            held.add(path)
        for path, value in result["every"].items():  # get_weights: every stage's, whole
            np.testing.assert_allclose(value, weights[path], rtol=1e-5, atol=1e-6, err_msg=path)
        np.testing.assert_allclose(result["predicted"], history["predicted"], rtol=1e-5, atol=1e-6)
        for name, value in history["evaluated"].items():
            np.testing.assert_allclose(result["evaluated"][name], value, rtol=1e-5, err_msg=name)
        assert result["digest"] == results[0]["digest"]
        # a sharded stage has no replica to compare: its parameters are one copy, checked at rest and gathered
        assert set(result["stage"]) <= set(result["one_copy"]) and not set(result["stage"]) & set(result["compared"])
    assert held == set(weights)
    loaded = mf.load_model(str(tmp_path / "model.keras"), module=Classifier())
    for path, value in loaded.module.state_dict().items():
        np.testing.assert_allclose(value.numpy(), weights[path], rtol=1e-5, atol=1e-6, err_msg=path)
    # the backup (both epochs done) restores in one plain process with the sharded pipeline's digest
    model = _model(None)
    x, y = _data(56)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
              callbacks=[mf.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=4, delete_checkpoint=False),
                         mf.callbacks.ModelCheckpoint(str(tmp_path / "restored.keras"))])  # the run's own callbacks
    assert mf.train.state_digest(model).total == results[0]["digest"]


def _deep() -> nn.Module:
    """Eight equal 64-wide layers: split at ``"4"``, two stages of equal size."""
    torch.manual_seed(3)
    return nn.Sequential(*(nn.Linear(64, 64) for _ in range(8)))


def _regression(rows: int = 32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    return rng.normal(size=(rows, 64)).astype("float32"), rng.normal(size=(rows, 64)).astype("float32")


def _kept_bytes(model: Any) -> int:
    """The bytes this process keeps of the parameters, their gradients and the optimizer state (each storage
    once; a sharded tensor's local shard)."""
    seen: set[int] = set()
    total = 0

    def add(tensor: Any) -> None:
        nonlocal total
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    for param in model.module.parameters():
        add(param)
        if param.grad is not None:
            add(param.grad)
    for state in model.optimizer.torch_optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                add(value)
    return total


def _trained(mesh_dims: list[tuple[str, int]] | None, sharded: bool) -> Any:
    import meshfit as mf

    if mesh_dims is None:
        model = mf.Model(_deep())
    else:
        mesh = mf.dtensor.create_mesh(mesh_dims)
        layout_map = mf.dtensor.LayoutMap.fully_sharded(mesh) if sharded else mf.dtensor.LayoutMap(mesh)
        with layout_map.pipeline(["4"], microbatches=2).scope():
            model = mf.Model(_deep())
    model.compile(optimizer=mf.optimizers.SGD(0.05, momentum=0.9), loss="mse")  # state: a momentum buffer
    x, y = _regression()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return model


def _memory(rank: int, world_size: int, mesh_dims: list[tuple[str, int]], sharded: bool) -> dict[str, Any]:
    model = _trained(mesh_dims, sharded)
    weights = [np.asarray(w) for w in model.get_weights()]
    return {"bytes": _kept_bytes(model), "weights": weights}


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(("mesh_dims", "sharded", "share"), [
    ([("pipe", 2), ("batch", 2)], True, 1 / 4),
    ([("pipe", 2)], False, 1 / 2),
])
def test_a_process_keeps_its_stage_share_of_the_training_state(mesh_dims: list[tuple[str, int]], sharded: bool,
                                                               share: float) -> None:
    """Parameters + gradients + SGD's momentum a process keeps, against one process's: 2 stages × 2 shards
    ≤ 1/4 + 5 %; 2 stages ≤ 1/2 + 5 % (another stage's parameters are released, not kept whole)."""
    one = _trained(None, False)
    whole = _kept_bytes(one)
    expected = [np.asarray(w) for w in one.get_weights()]
    results = run_distributed(_memory, world_size=int(np.prod([n for _, n in mesh_dims])), timeout=TIMEOUT - 60,
                              args=(mesh_dims, sharded))
    for result in results:
        assert result["bytes"] <= share * whole * 1.05, (result["bytes"], whole, result["bytes"] / whole)
        for got, want in zip(result["weights"], expected, strict=True):  # and it trained as one process
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _after_the_scope(rank: int, world_size: int) -> dict[str, Any]:
    import meshfit as mf

    mesh = mf.dtensor.create_mesh([("pipe", 2), ("batch", 2)])
    with mf.dtensor.LayoutMap(mesh).pipeline(["blocks.2"], microbatches=2).scope():
        model = _model(None)  # built, compiled and trained inside the scope, as a script often is
        x, y = _data()
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert model.residency.holds("blocks.2.fc.weight") == (mesh.device_mesh.get_local_rank("pipe") == 1)
    return {"weights": model.get_weights()}


@pytest.mark.timeout(TIMEOUT)
def test_training_inside_the_scope_keeps_the_trained_stages_when_the_scope_exits() -> None:
    """A script that builds, compiles and trains inside the scope (the seed tutorials' habit) on 2 stages × 2
    replicas: when the scope exits, every stage keeps its trained weights (none is replaced by rank 0's
    copy of another stage's, released or stale) and ``get_weights`` after the scope equals one process."""
    model = _model(None)
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    expected = model.get_weights()
    for result in run_distributed(_after_the_scope, world_size=4, timeout=TIMEOUT - 60):
        for got, want in zip(result["weights"], expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
