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

import os
import shutil
from typing import Any

import numpy as np
import pytest
import torch
from _multiproc import run_distributed
from _pipeline_model import Classifier
from _pipeline_run import _counting, _data, _every, _model, _one_process, _pipeline, refusal
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


SHARDED = (("pipe", 2), ("batch", 2))  # 2 stages x 2 shards on 4 processes


def _accumulated(mesh_dims: tuple[tuple[str, int], ...] | None, batch_size: int, accumulation: int, epochs: int,
                 validation: bool) -> dict[str, np.ndarray]:
    """Every weight after ``fit`` with ``gradient_accumulation_steps=accumulation`` (Adam 0.01), on sharded stages
    over ``mesh_dims`` or in one plain process (None); ``validation``: the first 16 rows at each epoch's end."""
    import meshfit as mf

    optimizer = mf.optimizers.Adam(0.01, gradient_accumulation_steps=accumulation)
    model = _model(None, optimizer=optimizer) if mesh_dims is None else \
        _model(mesh_dims, ["blocks.2"], microbatches=2, sharded=True, optimizer=optimizer)
    x, y = _data()
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
              validation_data=(x[:16], y[:16]) if validation else None)
    return _every(model)


def _accumulating(rank: int, world_size: int) -> dict[str, dict[str, np.ndarray]]:
    return {"twice the batch": _accumulated(SHARDED, 8, 2, 1, False),
            # a window across the epoch's end, where validation runs the schedule's eval in the window
            "validation": _accumulated(SHARDED, 16, 3, 2, True)}


@pytest.mark.timeout(TIMEOUT)
def test_gradient_accumulation_on_sharded_stages_equals_one_process() -> None:
    """``gradient_accumulation_steps=2`` on 2 stages x 2 shards, batch 8 (2 rows a microbatch on each replica):
    a window's two reduce-scattered batches sum to one process's batch of 16 (the sharded analogue of
    test_pipeline.py's test_gradient_accumulation_under_a_pipeline_equals_one_process_with_twice_the_batch);
    and a window of 3 across an epoch's end with validation equals one process's (as test_pipeline.py's
    test_accumulation_windows_under_a_pipeline_equal_one_process)."""
    references = {"twice the batch": _accumulated(None, 16, 1, 1, False), "validation": _accumulated(None, 16, 3, 2, True)}
    for result in run_distributed(_accumulating, world_size=4, timeout=TIMEOUT - 60):
        for case, every in result.items():
            assert set(every) == set(references[case]), case
            for path, value in every.items():
                np.testing.assert_allclose(value, references[case][path], rtol=1e-5, atol=1e-6, err_msg=(case, path))


def _half(rank: int, world_size: int, policy: str) -> list[float]:
    import meshfit as mf

    mf.mixed_precision.set_global_policy(policy)
    model = _model(SHARDED, ["blocks.2"], microbatches=2, sharded=True)
    x, y = _data()
    return model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_on_sharded_stages_follows_one_process(policy: str) -> None:
    """The sharded stages compute in the policy's dtype as one process does, within test_pipeline.py's tolerance
    for test_mixed_precision_under_a_pipeline_follows_one_process (1e-4 relative: the half precision rounds
    each microbatch alone), and nearer one such process than one float32 process: 4 times nearer under bfloat16;
    float16 keeps 3 more bits and lies nearer float32 (6e-6 from it on the first epoch's loss; 1.9e-6 measured
    here), so 2 times nearer."""
    import meshfit as mf

    x, y = _data()
    mf.mixed_precision.set_global_policy(policy)
    try:
        reference = _model(None).fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    finally:
        mf.mixed_precision.set_global_policy("float32")
    float32 = _model(None).fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history["loss"][0]
    for losses in run_distributed(_half, world_size=4, timeout=TIMEOUT - 60, args=(policy,)):
        np.testing.assert_allclose(losses, reference, rtol=1e-4)
        nearer = {"mixed_bfloat16": 4, "mixed_float16": 2}[policy]
        assert abs(losses[0] - reference[0]) < abs(float32 - reference[0]) / nearer, (losses, reference, float32)


def _moving_averages(rank: int, world_size: int, backup: str) -> dict[str, dict[str, np.ndarray]]:
    import meshfit as mf

    def sharded() -> Any:
        return _model(SHARDED, ["blocks.2"], microbatches=2, sharded=True,
                      optimizer=mf.optimizers.Adam(0.01, use_ema=True))

    x, y = _data()
    model = sharded()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
              callbacks=[mf.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    restored = sharded()  # the backup back on sharded stages: resumes at the end, fit's end swaps the averages in
    restored.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                 callbacks=[mf.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    return {"trained": _every(model), "restored": _every(restored)}


@pytest.mark.timeout(TIMEOUT)
def test_a_sharded_pipeline_backup_holds_every_stage_moving_averages(tmp_path: Any) -> None:
    """``use_ema`` on 2 stages x 2 shards: each stage's moving averages (sharded as its parameters) are
    gathered into the backup, so one plain process restoring it ends with one process's averaged weights,
    and so do sharded stages restoring it (the averages resharded on load). The sharded analogue of
    test_pipeline.py's test_a_pipeline_backup_holds_every_stage_moving_averages."""
    import meshfit as mf

    def fresh() -> Any:
        return _model(None, optimizer=mf.optimizers.Adam(0.01, use_ema=True))

    x, y = _data()
    reference = fresh()
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    weights = {k: v.detach().numpy() for k, v in reference.module.state_dict().items()}
    backup = str(tmp_path / "backup")
    for result in run_distributed(_moving_averages, world_size=4, timeout=TIMEOUT - 60, args=(backup,)):
        for case, every in result.items():
            assert set(every) == set(weights), case
            for path, value in every.items():
                np.testing.assert_allclose(value, weights[path], rtol=1e-5, atol=1e-6, err_msg=(case, path))
    restored = fresh()
    restored.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                 callbacks=[mf.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    for path, value in restored.module.state_dict().items():
        np.testing.assert_allclose(value.numpy(), weights[path], rtol=1e-5, atol=1e-6, err_msg=path)


INTERLEAVED = {"split_points": ["blocks.1", "blocks.2", "blocks.3"], "schedule": "Interleaved1F1B",
               "stages_per_rank": 2}  # 4 stages x 2 shards on 4 processes (each rank keeps its place in the stages)
TRANSPOSED = (("batch", 2), ("pipe", 2))  # the same 2 stages x 2 replicas, the ranks laid out the other way


class _Stop(Exception):
    pass


def _interrupting(stop_at: int | None) -> Any:
    """A callback that raises `_Stop` before batch ``stop_at`` (counted over the run); None: never."""
    import meshfit as mf

    class Interrupt(mf.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if stop_at is not None and self.model.optimizer.batches == stop_at:
                raise _Stop

    return Interrupt()


def _backed_up(backup: str, sharded: bool, stop_at: int | None = None, mesh_dims: tuple[tuple[str, int], ...] = SHARDED,
               split_points: tuple[str, ...] | list[str] = ("blocks.2",), **options: Any) -> dict[str, Any] | None:
    """2 epochs of 4 steps on pipeline stages x 2 replicas (fully sharded, or replicated), a backup every 3 steps;
    stopped before step ``stop_at`` (None), or the logs, the steps run and every weight."""
    import meshfit as mf

    model = _model(mesh_dims, list(split_points), microbatches=2, sharded=sharded, **options)
    x, y = _data()
    steps: list[int] = []
    try:
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                            callbacks=[mf.callbacks.BackupAndRestore(backup, save_freq=3, async_save=False,
                                                                     delete_checkpoint=False),
                                       _counting(steps), _interrupting(stop_at)])
    except _Stop:
        return None
    return {"history": history.history, "steps": len(steps), "every": _every(model)}


def _interrupted(rank: int, world_size: int, directory: str) -> None:
    _backed_up(os.path.join(directory, "from_sharded"), True, stop_at=5)  # the last backup: step 3 of 4
    _backed_up(os.path.join(directory, "from_replicated"), False, stop_at=5)


def _resumed(rank: int, world_size: int, directory: str) -> dict[str, dict[str, Any] | None]:
    return {"sharded": _backed_up(os.path.join(directory, "to_sharded"), True),
            "replicated": _backed_up(os.path.join(directory, "to_replicated"), False),
            "sharded, another depth": _backed_up(os.path.join(directory, "to_deeper"), True, **INTERLEAVED)}


@pytest.mark.timeout(TIMEOUT)
def test_a_backup_of_sharded_stages_resumes_on_replicated_stages_and_back(tmp_path: Any) -> None:
    """2 stages x 2 shards and 2 stages x 2 replicas, each stopped in the second epoch with a backup at step 3 of
    the first (mid-epoch: the data position and the epoch's metric state in it too); each backup resumed on the
    other kind of stages and the sharded one also on 4 interleaved sharded stages (another depth): all run the 5
    remaining steps and end at one uninterrupted process's weights and logs; in one plain process, at its weights
    (its logs: test_a_mid_epoch_backup_of_sharded_stages_resumes_where_other_ranks_hold_the_outputs). The sharded
    analogue of test_pipeline.py's test_a_pipeline_backup_resumes_on_another_depth_and_in_one_plain_process."""
    import meshfit as mf

    weights, history, _ = _one_process()
    directory = str(tmp_path)
    run_distributed(_interrupted, world_size=4, timeout=TIMEOUT - 60, args=(directory,))
    shutil.copytree(tmp_path / "from_sharded", tmp_path / "to_replicated")
    shutil.copytree(tmp_path / "from_replicated", tmp_path / "to_sharded")
    shutil.copytree(tmp_path / "from_sharded", tmp_path / "to_deeper")
    for result in run_distributed(_resumed, world_size=4, timeout=TIMEOUT - 60, args=(directory,)):
        for case, run in result.items():
            assert run is not None and run["steps"] == 5, case  # resumed after step 3, not trained from the start
            np.testing.assert_allclose(run["history"]["loss"], history["loss"], rtol=1e-5, err_msg=case)
            assert set(run["every"]) == set(weights), case
            for path, value in run["every"].items():
                np.testing.assert_allclose(value, weights[path], rtol=1e-5, atol=1e-6, err_msg=(case, path))
    model = _model(None)
    x, y = _data()
    steps: list[int] = []
    resumed = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                        callbacks=[mf.callbacks.BackupAndRestore(str(tmp_path / "from_sharded"),
                                                                 delete_checkpoint=False), _counting(steps)])
    assert len(steps) == 5 and len(resumed.history["loss"]) == 2
    for path, value in model.module.state_dict().items():
        np.testing.assert_allclose(value.numpy(), weights[path], rtol=1e-5, atol=1e-6, err_msg=path)


def _relaid(rank: int, world_size: int, directory: str) -> dict[str, Any] | None:
    backup = os.path.join(directory, "backup")
    _backed_up(backup, True, stop_at=5)  # on (pipe, batch): the last backup at step 3 of the first epoch's 4
    if rank == 0:  # for one plain process (no save comes before every rank is in the next fit)
        shutil.copytree(backup, os.path.join(directory, "copy"))
    return _backed_up(backup, True, mesh_dims=TRANSPOSED)  # on (batch, pipe): rank 1 now holds the last stage


@pytest.mark.timeout(TIMEOUT)
def test_a_mid_epoch_backup_of_sharded_stages_resumes_where_other_ranks_hold_the_outputs(tmp_path: Any) -> None:
    """A backup at step 3 of 4 on ``[("pipe", 2), ("batch", 2)]`` (the outputs, the loss and the metrics on ranks
    2 and 3) resumed on ``[("batch", 2), ("pipe", 2)]`` (on ranks 1 and 3), and in one plain process: weights and
    both epochs' logs as one uninterrupted process's on (batch, pipe) (each rank restores the sums of the rank
    that held its stages in its replica). One plain process holds every stage: the weights and the second
    epoch are one process's; the resumed epoch's logs count the steps after the resume (documented)."""
    import meshfit as mf

    weights, history, _ = _one_process()
    for run in run_distributed(_relaid, world_size=4, timeout=TIMEOUT - 60, args=(str(tmp_path),)):
        assert run is not None and run["steps"] == 5
        for path, value in run["every"].items():
            np.testing.assert_allclose(value, weights[path], rtol=1e-5, atol=1e-6, err_msg=path)
        np.testing.assert_allclose(run["history"]["loss"], history["loss"], rtol=1e-5, err_msg="(batch, pipe)")
    x, y = _data()
    model = _model(None)
    resumed = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                        callbacks=[mf.callbacks.BackupAndRestore(str(tmp_path / "copy"))])
    for path, value in model.module.state_dict().items():
        np.testing.assert_allclose(value.numpy(), weights[path], rtol=1e-5, atol=1e-6, err_msg=path)
    np.testing.assert_allclose(resumed.history["loss"][1], history["loss"][1], rtol=1e-5, err_msg="one plain process")


def test_a_fully_sharded_pipeline_map_on_a_mesh_with_no_data_axis_is_refused_by_name() -> None:
    import meshfit as mf

    mesh = mf.dtensor.Mesh(("pipe",), (2,))
    with pytest.raises(ValueError, match=r"Invalid mesh for LayoutMap.fully_sharded: expected a mesh with a data "
                                         r"axis.*received Mesh\(pipe=2.*create_mesh\(\[\('batch', N\)\]\)"):
        mf.dtensor.LayoutMap.fully_sharded(mesh).pipeline(["blocks.2"], microbatches=2)


def _empty_share(rank: int, world_size: int) -> str:
    import meshfit as mf

    # 49 rows by 16: a last global batch of 1 row, split 1 + 0 over the replicas (one microbatch, GPipe)
    model = _model(SHARDED, ["blocks.2"], microbatches=1, schedule="GPipe", sharded=True,
                   optimizer=mf.optimizers.Adam(0.01))
    x, y = _data(49)
    return refusal(lambda: model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0))


@pytest.mark.timeout(TIMEOUT)
def test_a_sharded_stage_with_an_empty_share_is_refused_on_every_replica() -> None:
    """A replicated stage's empty share joins the reduction with zeros (test_pipeline.py's
    test_a_replica_with_an_empty_share_joins_the_reduction_and_keeps_its_window); a sharded stage's replicas
    all-gather and reduce-scatter inside the schedule, so an empty share is refused, on all four processes
    together (none waits in a collective for another's error)."""
    for message in run_distributed(_empty_share, world_size=4, timeout=TIMEOUT - 60):
        assert "a batch of 0 rows" in message or "a batch of 1 rows" in message, message
        assert "of 1 in all replicas" in message and "fully sharded stages need rows on every replica" in message, \
            message


def _windowed(backup: str, stop_at: int | None,
              mesh_dims: tuple[tuple[str, int], ...] = SHARDED) -> tuple[list[np.ndarray], int] | None:
    """2 epochs of 8 batches of 8 on sharded stages, ``gradient_accumulation_steps=2``, a backup after every
    batch; raise before batch ``stop_at`` (counted over the run), or run to the end."""
    import meshfit as mf

    model = _model(mesh_dims, ["blocks.2"], microbatches=2, sharded=True,
                   optimizer=mf.optimizers.Adam(0.01, gradient_accumulation_steps=2))
    x, y = _data()
    try:
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                  callbacks=[mf.callbacks.BackupAndRestore(backup, save_freq=1, async_save=False,
                                                           delete_checkpoint=False), _interrupting(stop_at)])
    except _Stop:
        return None
    return model.get_weights(), model.optimizer.batches


def _inside_a_window(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    whole = _windowed(os.path.join(directory, "whole"), None)
    stopped = _windowed(os.path.join(directory, "backup"), 11)  # the second epoch's second window, after 1 batch
    resumed = _windowed(os.path.join(directory, "backup"), None)
    return {"whole": whole, "stopped": stopped, "resumed": resumed}


@pytest.mark.timeout(TIMEOUT)
def test_a_backup_of_sharded_stages_inside_an_accumulation_window_resumes_bitwise(tmp_path: Any) -> None:
    """A backup taken inside a window keeps each shard's partial gradient sum; the stages resumed from it end
    bitwise equal to a run never stopped (the sharded analogue of test_gradient_accumulation.py's
    test_a_backup_inside_a_window_resumes_bitwise_equal_to_a_run_never_stopped)."""
    for result in run_distributed(_inside_a_window, world_size=4, timeout=TIMEOUT - 60, args=(str(tmp_path),)):
        assert result["stopped"] is None
        (weights, batches), (want, whole_batches) = result["resumed"], result["whole"]
        assert batches == whole_batches == 16
        for got, expected in zip(weights, want, strict=True):
            np.testing.assert_array_equal(got, expected)


def _window_relaid(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    whole = _windowed(os.path.join(directory, "whole"), None)
    _windowed(os.path.join(directory, "backup"), 11)  # inside the second epoch's second window
    if rank == 0:  # for one plain process (no save comes before every rank is in the next fit)
        shutil.copytree(os.path.join(directory, "backup"), os.path.join(directory, "copy"))
    return {"whole": whole, "resumed": _windowed(os.path.join(directory, "backup"), None, TRANSPOSED)}


@pytest.mark.timeout(TIMEOUT)
def test_a_backup_inside_an_accumulation_window_resumes_on_the_ranks_laid_out_the_other_way(tmp_path: Any) -> None:
    """The window's sums saved on ``[("pipe", 2), ("batch", 2)]`` reach the ranks that hold their stages on
    ``[("batch", 2), ("pipe", 2)]``: the resumed run ends at the uninterrupted run's weights. One plain process
    holds every stage, and the window's sums were split by stage: it refuses the backup, naming the fix."""
    import meshfit as mf

    for result in run_distributed(_window_relaid, world_size=4, timeout=TIMEOUT - 60, args=(str(tmp_path),)):
        (weights, batches), (want, _) = result["resumed"], result["whole"]
        assert batches == 16
        for got, expected in zip(weights, want, strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    model = _model(None, optimizer=mf.optimizers.Adam(0.01, gradient_accumulation_steps=2))
    with pytest.raises(ValueError, match="inside a gradient accumulation window.*Resume on the layout that saved it"):
        model.fit(*_data(), batch_size=8, epochs=2, shuffle=False, verbose=0,
                  callbacks=[mf.callbacks.BackupAndRestore(str(tmp_path / "copy"))])


def _last_batch_reads(rank: int, world_size: int, rows: int, microbatches: int, schedule: str,
                      sharded: bool = True) -> dict[str, Any]:
    """predict, then evaluate, on sharded (or replicated) stages over ``rows`` rows by 16, before any ``fit``:
    each call's result, or the message of its refusal."""
    model = _model(SHARDED, ["blocks.2"], microbatches=microbatches, schedule=schedule, sharded=sharded)
    x, y = _data(rows)
    reads: dict[str, Any] = {}
    for name, call in (("predict", lambda: np.asarray(model.predict(x, batch_size=16, verbose=0))),
                       ("evaluate", lambda: model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True))):
        try:
            reads[name] = call()
        except ValueError as error:
            if "Invalid batch for the pipeline" not in str(error):
                raise  # torch's own (a replica failing alone): end this process, the run fails at once
            reads[name] = str(error)
    return reads


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(("rows", "microbatches", "schedule"), [(49, 1, "GPipe"), (50, 2, "1F1B")],
                         ids=["an-empty-share", "a-share-that-does-not-split"])
@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "replicated"])
def test_predict_and_evaluate_a_small_last_batch_on_sharded_stages_end_together(rows: int, microbatches: int,
                                                                                schedule: str, sharded: bool) -> None:
    """A last global batch of 1 row (one replica's share empty) or 2 rows (1 a replica, for 2 microbatches): the
    stages read it as one process does, or refuse it on every replica together as ``fit`` does (evaluate refuses
    the 2 rows so already): never one replica failing alone while the other waits in a collective."""
    one = _model(None)
    x, y = _data(rows)
    predicted = np.asarray(one.predict(x, batch_size=16, verbose=0))
    evaluated = one.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    refusals = ("fully sharded stages need rows on every replica", "a prediction needs rows on every replica",
                f"does not split into microbatches={microbatches}")
    for reads in run_distributed(_last_batch_reads, world_size=4, timeout=60,
                                 args=(rows, microbatches, schedule, sharded)):
        for name, expected in (("predict", predicted), ("evaluate", evaluated)):
            read = reads[name]
            if isinstance(read, str):  # refused on every replica together, naming why
                assert any(reason in read for reason in refusals), (name, read)
                # replicated stages evaluate an empty share as one process does: only predict needs the rows
                assert name == "predict" or sharded or microbatches > 1, (name, read)
            elif name == "predict":
                np.testing.assert_allclose(read, expected, rtol=1e-5, atol=1e-6)
            else:
                for metric, value in expected.items():
                    np.testing.assert_allclose(read[metric], value, rtol=1e-5, err_msg=metric)


def _flipping(at: int, rank: int) -> Any:
    """A callback: process ``rank`` flips one bit of its shard of ``head.weight`` (the last stage's) before
    step ``at`` + 1 runs, once, as a faulty memory cell would."""
    import meshfit as mf

    class Flip(mf.callbacks.Callback):
        reads_batch_logs = False

        def __init__(self) -> None:
            super().__init__()
            self.left = 1

        def on_train_batch_begin(self, batch, logs=None):
            if self.left and self.model.optimizer.iterations == at and mf.distribute.current_world().rank == rank:
                with torch.no_grad():
                    self.model.module.head.weight.to_local().view(-1).view(torch.int32)[1] ^= 1 << 22
                self.left -= 1

    return Flip()


def _flipped(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    import meshfit as mf

    x, y = _data()
    out: dict[str, Any] = {}
    undisturbed = _model(SHARDED, ["blocks.2"], microbatches=2, sharded=True)
    undisturbed.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    out["undisturbed"] = undisturbed.get_weights()
    try:
        _model(SHARDED, ["blocks.2"], microbatches=2, sharded=True).fit(
            x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
            callbacks=[_flipping(5, 3), mf.callbacks.VerifyReplicas(every_n_steps=1, on_divergence="stop")])
        out["stopped"] = None
    except mf.ReplicaDivergenceError as error:
        out["stopped"] = (error.step, error.path, list(error.ranks))
    verify = mf.callbacks.VerifyReplicas(every_n_steps=1, on_divergence="restore")
    model = _model(SHARDED, ["blocks.2"], microbatches=2, sharded=True)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
              callbacks=[_flipping(5, 3), verify,
                         mf.callbacks.BackupAndRestore(os.path.join(directory, "backup"), save_freq=2)])
    out["restored"] = model.get_weights()
    out["rollbacks"] = [(error.step, error.path) for error, _ in verify.rollbacks]
    return out


@pytest.mark.timeout(TIMEOUT)
def test_a_bit_flipped_in_a_sharded_stage_at_rest_is_found_and_rolled_back_bitwise(tmp_path: Any) -> None:
    """A sharded stage's parameters are one copy: a bit flipped in rank 3's shard of ``head.weight`` between
    steps 5 and 6 is found at rest by every worker (named with its rank; "stop" raises it everywhere), and
    "restore" rolls every worker back to the backup of step 4, ending bitwise equal to the undisturbed run. Ported
    to pipeline stages from tests/test_verify_one_copy.py's
    test_one_copy_tensors_are_named_checked_at_rest_and_after_gathering (a flip in one process's FSDP shard)."""
    for result in run_distributed(_flipped, world_size=4, timeout=TIMEOUT - 60, args=(str(tmp_path),)):
        assert result["stopped"] == (5, "head.weight", [3]), result["stopped"]
        assert result["rollbacks"] == [(5, "head.weight")], result["rollbacks"]
        for got, want in zip(result["restored"], result["undisturbed"], strict=True):
            np.testing.assert_array_equal(got, want)
