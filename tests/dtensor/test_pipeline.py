"""Pipeline parallelism behind ``fit``: stages along a ``pipe`` axis equal one plain process.

A small sequence classifier (token and position embeddings, positions from ``torch.arange`` inside
``forward``, four residual blocks, a head) is split at ``blocks.2`` (or at every block for the
interleaved schedule, four stages on two ranks) and trained by ``fit`` with torch's schedules. Every
schedule must give one process's weights on the same global batch (fp32 rounding: microbatches sum
the gradient in another order), its logged loss and accuracy, and a backup one plain process restores.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch
from _multiproc import run_distributed
from _pipeline_model import Classifier
from _pipeline_run import _counting, _data, _every, _model, _one_process, _pipeline, refusal

TIMEOUT = 300


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(("schedule", "split_points", "stages_per_rank"), [
    ("GPipe", ["blocks.2"], 1),
    ("1F1B", ["blocks.2"], 1),
    ("Interleaved1F1B", ["blocks.1", "blocks.2", "blocks.3"], 2),
])
def test_pipeline_fit_equals_one_process(tmp_path: Any, schedule: str, split_points: list[str],
                                         stages_per_rank: int) -> None:
    import meshfit as mf

    weights, history, _ = _one_process()
    results = run_distributed(_pipeline, world_size=2, timeout=TIMEOUT - 60,
                              args=(str(tmp_path), schedule, split_points, stages_per_rank))
    held = set()
    for result in results:
        for name in ("loss", "accuracy"):  # the true logs, on every worker (not one stage's share or zero)
            np.testing.assert_allclose(result["history"][name], history[name], rtol=1e-5, err_msg=name)
        for path, value in result["stage"].items():
            np.testing.assert_allclose(value, weights[path], rtol=1e-5, atol=1e-6, err_msg=path)
            held.add(path)
        # a metric read directly in a callback is the model's value on every process, not this stage's share
        for epoch, values in enumerate(result["read"]):
            np.testing.assert_allclose(values["loss"], history["loss"][epoch], rtol=1e-5)
            np.testing.assert_allclose(values["accuracy"], history["accuracy"][epoch], rtol=1e-5)
        # evaluate and predict run the schedule too: one process's values on its weights
        np.testing.assert_allclose(result["predicted"], history["predicted"], rtol=1e-5, atol=1e-6)
        for name, value in history["evaluated"].items():
            np.testing.assert_allclose(result["evaluated"][name], value, rtol=1e-5, err_msg=name)
        for path, value in result["every"].items():  # get_weights: no stage's stale copy of another's
            np.testing.assert_allclose(value, weights[path], rtol=1e-5, atol=1e-6, err_msg=path)
        assert result["digest"] == results[0]["digest"]
    assert held == set(weights)  # every path is some stage's
    for result in results:  # one copy of each stage: nothing to compare but the step count
        assert result["compared"] == ("optimizer/iterations",) and set(result["stage"]) <= set(result["one_copy"])
    # model.save wrote every stage's weights: one plain process loads them
    # ModelCheckpoint saved through the same path at each epoch's end: the last one holds the final weights
    checkpointed = mf.load_model(str(tmp_path / "epoch.keras"), module=Classifier())
    for path, value in checkpointed.module.state_dict().items():
        np.testing.assert_allclose(value.numpy(), weights[path], rtol=1e-5, atol=1e-6, err_msg=path)
    loaded = mf.load_model(str(tmp_path / "model.keras"), module=Classifier())
    for path, value in loaded.module.state_dict().items():
        np.testing.assert_allclose(value.numpy(), weights[path], rtol=1e-5, atol=1e-6, err_msg=path)
    # the backup (the last one: both epochs done) restores in one plain process with the pipeline's digest
    model = _model(None)
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
              callbacks=[mf.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=4, delete_checkpoint=False),
                         mf.callbacks.ModelCheckpoint(str(tmp_path / "restored.keras"))])  # the run's own callbacks
    assert mf.train.state_digest(model).total == results[0]["digest"]


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("mesh_dims", [(("pipe", 2), ("batch", 2)), (("batch", 2), ("pipe", 2))])
def test_pipeline_with_replicated_stages_equals_one_process(tmp_path: Any, mesh_dims: tuple) -> None:
    """2 stages × 2 data replicas on 4 processes, the last global batch smaller (56 rows by 16: 8, split 4 + 4)."""
    weights, history, _ = _one_process(56)
    results = run_distributed(_pipeline, world_size=4, timeout=TIMEOUT - 60,
                              args=(str(tmp_path), "1F1B", ["blocks.2"], 1, mesh_dims, 56, 2))
    for result in results:
        for name in ("loss", "accuracy"):
            np.testing.assert_allclose(result["history"][name], history[name], rtol=1e-5, err_msg=name)
        for path, value in result["every"].items():
            np.testing.assert_allclose(value, weights[path], rtol=1e-5, atol=1e-6, err_msg=path)
        assert result["digest"] == results[0]["digest"]
    # the replica check compares every stage's tensors with the stage's replicas (never across stages)
    for result in results:
        assert set(result["stage"]) <= set(result["compared"]) and not result["one_copy"]
    # each stage's replicas hold bitwise the same weights (they were reduced alike)
    by_path: dict[str, list[np.ndarray]] = {}
    for result in results:
        for path, value in result["stage"].items():
            by_path.setdefault(path, []).append(value)
    assert set(by_path) == set(weights)
    for path, copies in by_path.items():
        assert len(copies) == 2, path
        np.testing.assert_array_equal(copies[0], copies[1], err_msg=path)


def _both_spellings(rank: int, world_size: int) -> dict[str, Any]:
    import meshfit as mf

    def train() -> tuple[list[np.ndarray], list[float]]:
        model = _model(None)
        x, y = _data()
        history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return model.get_weights(), history.history["loss"]

    mesh = mf.dtensor.create_mesh([("pipe", 2), ("batch", 2)])
    with mf.dtensor.LayoutMap(mesh).pipeline(["blocks.2"], microbatches=2).scope():
        dtensor = train()
    device_mesh = mf.distribution.DeviceMesh((2, 2), ["pipe", "batch"], mf.distribution.list_devices())
    layout_map = mf.distribution.LayoutMap(device_mesh).pipeline(["blocks.2"], microbatches=2)
    mf.distribution.set_distribution(mf.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    try:
        keras = train()
    finally:
        mf.distribution.set_distribution(None)
    return {"dtensor": dtensor, "keras": keras}


@pytest.mark.timeout(TIMEOUT)
def test_keras_spelling_reaches_the_pipeline_bitwise() -> None:
    """``mf.distribution.ModelParallel`` with a ``LayoutMap(...).pipeline(...)`` runs the same placement as the
    DTensor spelling: bitwise equal weights and losses on 2 stages x 2 replicas, equal to one process."""
    weights, history, _ = _one_process(epochs=1)
    results = run_distributed(_both_spellings, world_size=4, timeout=TIMEOUT - 60)
    for result in results:
        (dtensor, dtensor_loss), (keras, keras_loss) = result["dtensor"], result["keras"]
        assert dtensor_loss == keras_loss
        for a, b in zip(dtensor, keras, strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(keras_loss, history["loss"], rtol=1e-5)
        for a, path in zip(keras, weights, strict=True):
            np.testing.assert_allclose(a, weights[path], rtol=1e-5, atol=1e-6, err_msg=path)


def _accumulating(rank: int, world_size: int) -> dict[str, Any]:
    import meshfit as mf

    model = _model([("pipe", 2), ("batch", 2)], ["blocks.2"], microbatches=2,
                   optimizer=mf.optimizers.Adam(0.01, gradient_accumulation_steps=2))
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return {"every": _every(model)}


@pytest.mark.timeout(TIMEOUT)
def test_gradient_accumulation_under_a_pipeline_equals_one_process_with_twice_the_batch() -> None:
    """``gradient_accumulation_steps=2`` on 2 stages x 2 replicas, batch 8: one process's batch of 16."""
    import meshfit as mf

    model = _model(None, optimizer=mf.optimizers.Adam(0.01))
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    weights = {k: v.detach().numpy() for k, v in model.module.state_dict().items()}
    for result in run_distributed(_accumulating, world_size=4, timeout=TIMEOUT - 60):
        for path, value in result["every"].items():
            np.testing.assert_allclose(value, weights[path], rtol=1e-5, atol=1e-6, err_msg=path)


def _bfloat16(rank: int, world_size: int, policy: str = "mixed_bfloat16") -> list[float]:
    import meshfit as mf

    mf.mixed_precision.set_global_policy(policy)
    model = _model([("pipe", 2)], ["blocks.2"], microbatches=2)
    x, y = _data()
    return model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_under_a_pipeline_follows_one_process(policy: str) -> None:
    """The stages compute in the policy's dtype as one process does (the schedule runs inside the step's
    autocast; under ``mixed_float16`` the backward starts from the loss scale optimizer's scaled loss). The
    half precision rounds each microbatch alone: 1e-4 relative here (measured 6e-5 for bfloat16)."""
    import meshfit as mf

    mf.mixed_precision.set_global_policy(policy)
    try:
        model = _model(None)
        x, y = _data()
        reference = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    finally:
        mf.mixed_precision.set_global_policy("float32")
    model = _model(None)
    float32 = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history["loss"][0]
    for losses in run_distributed(_bfloat16, world_size=2, timeout=TIMEOUT - 60, args=(policy,)):
        np.testing.assert_allclose(losses, reference, rtol=1e-4)
        # bfloat16 indeed: the first epoch's loss is bfloat16's (6e-6 from it), not float32's (1.6e-4 away)
        assert abs(losses[0] - reference[0]) < abs(float32 - reference[0]) / 4, (losses, reference, float32)


def _moving_averages(rank: int, world_size: int, backup: str) -> None:
    import meshfit as mf

    model = _model([("pipe", 2)], ["blocks.2"], microbatches=2, optimizer=mf.optimizers.Adam(0.01, use_ema=True))
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
              callbacks=[mf.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])


@pytest.mark.timeout(TIMEOUT)
def test_a_pipeline_backup_holds_every_stage_moving_averages(tmp_path: Any) -> None:
    """``use_ema``: the backup's moving averages come from the stage that trains each parameter, so one plain
    process restoring it ends with one process's averaged weights."""
    import meshfit as mf

    def fresh() -> Any:
        model = _model(None, optimizer=mf.optimizers.Adam(0.01, use_ema=True))
        return model

    x, y = _data()
    reference = fresh()
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    backup = str(tmp_path / "backup")
    run_distributed(_moving_averages, world_size=2, timeout=TIMEOUT - 60, args=(backup,))
    restored = fresh()  # resumes at the end (no step runs); fit's end swaps the restored averages in
    restored.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                 callbacks=[mf.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    for (path, a), b in zip(reference.module.state_dict().items(), restored.module.state_dict().values(), strict=True):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6, err_msg=path)


CLASS_WEIGHT = {0: 1.0, 1: 2.5, 2: 0.5}


def _weighted(rank: int, world_size: int, schedule: str, split_points: list[str], stages_per_rank: int) -> dict:

    model = _model([("pipe", 2)], split_points, microbatches=4, schedule=schedule, stages_per_rank=stages_per_rank)
    x, y = _data()
    history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, class_weight=CLASS_WEIGHT)
    return {"loss": history.history["loss"], "every": _every(model)}


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(("schedule", "split_points", "stages_per_rank"), [
    ("1F1B", ["blocks.2"], 1), ("Interleaved1F1B", ["blocks.1", "blocks.2", "blocks.3"], 2)])
def test_class_weight_under_a_pipeline_equals_one_process(schedule: str, split_points: list[str],
                                                           stages_per_rank: int) -> None:
    """Each microbatch's loss takes its own rows' sample weights (``class_weight`` here)."""

    model = _model(None)
    x, y = _data()
    history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, class_weight=CLASS_WEIGHT)
    weights = {k: v.detach().numpy() for k, v in model.module.state_dict().items()}
    for result in run_distributed(_weighted, world_size=2, timeout=TIMEOUT - 60,
                                  args=(schedule, split_points, stages_per_rank)):
        np.testing.assert_allclose(result["loss"], history.history["loss"], rtol=1e-5)
        for path, value in result["every"].items():
            np.testing.assert_allclose(value, weights[path], rtol=1e-5, atol=1e-6, err_msg=path)


class _WithUnused(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Linear(8, 8)  # in the last stage, never called


def _decayed(rank: int, world_size: int) -> dict[str, np.ndarray]:
    import meshfit as mf

    model = _model([("pipe", 2), ("batch", 2)], ["blocks.2"], microbatches=2, module=_WithUnused,
                   optimizer=mf.optimizers.AdamW(0.01, weight_decay=0.1))
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return _every(model)


@pytest.mark.timeout(TIMEOUT)
def test_a_parameter_no_step_reaches_is_left_alone_as_one_process_leaves_it() -> None:
    """A stage's parameter that the forward never uses keeps no gradient on any replica, so AdamW's decay
    leaves it alone as in one process (a zero gradient would decay it)."""
    import meshfit as mf

    model = _model(None, module=_WithUnused, optimizer=mf.optimizers.AdamW(0.01, weight_decay=0.1))
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    weights = {k: v.detach().numpy() for k, v in model.module.state_dict().items()}
    for every in run_distributed(_decayed, world_size=4, timeout=TIMEOUT - 60):
        np.testing.assert_array_equal(every["unused.weight"], weights["unused.weight"])
        for path, value in every.items():
            np.testing.assert_allclose(value, weights[path], rtol=1e-5, atol=1e-6, err_msg=path)


def _fit_weights(mesh_dims: list[tuple[str, int]], rows: int, batch_size: int, microbatches: int,
                 accumulation: int, validation: bool = False, schedule: str = "1F1B") -> dict[str, np.ndarray]:
    import meshfit as mf

    model = _model(mesh_dims, ["blocks.2"], microbatches=microbatches, schedule=schedule,
                   optimizer=mf.optimizers.Adam(0.01, gradient_accumulation_steps=accumulation))
    x, y = _data(rows)
    model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0,
              validation_data=(x[:16], y[:16]) if validation else None)
    return _every(model)


def _one_process_weights(rows: int, batch_size: int, accumulation: int, validation: bool = False) -> dict:
    import meshfit as mf

    model = _model(None, optimizer=mf.optimizers.Adam(0.01, gradient_accumulation_steps=accumulation))
    x, y = _data(rows)
    model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0,
              validation_data=(x[:16], y[:16]) if validation else None)
    return {k: v.detach().numpy() for k, v in model.module.state_dict().items()}


def _windows(rank: int, world_size: int) -> dict[str, dict[str, np.ndarray]]:
    return {
        # accumulation on stages alone: torch's schedule would divide the window's earlier sum by the microbatches
        "pipe": _fit_weights([("pipe", 2)], 64, 16, 4, 2),
        # a window across the epoch's end, where validation runs the schedule's eval (which divides too)
        "validation": _fit_weights([("pipe", 2)], 64, 16, 4, 3, validation=True),
    }


@pytest.mark.timeout(TIMEOUT)
def test_accumulation_windows_under_a_pipeline_equal_one_process() -> None:
    references = {"pipe": _one_process_weights(64, 16, 2), "validation": _one_process_weights(64, 16, 3, True)}
    for result in run_distributed(_windows, world_size=2, timeout=TIMEOUT - 60):
        for case, every in result.items():
            for path, value in every.items():
                np.testing.assert_allclose(value, references[case][path], rtol=1e-5, atol=1e-6, err_msg=(case, path))


def _empty_share(rank: int, world_size: int) -> dict[str, np.ndarray]:
    # 49 rows by 16: a last global batch of 1 row, so one replica's share is empty, inside a window of 2
    # (one microbatch: GPipe takes fewer microbatches than stages, 1F1B does not)
    return _fit_weights([("pipe", 2), ("batch", 2)], 49, 16, 1, 2, schedule="GPipe")


@pytest.mark.timeout(TIMEOUT)
def test_a_replica_with_an_empty_share_joins_the_reduction_and_keeps_its_window() -> None:
    reference = _one_process_weights(49, 16, 2)
    for every in run_distributed(_empty_share, world_size=4, timeout=TIMEOUT - 60):
        for path, value in every.items():
            np.testing.assert_allclose(value, reference[path], rtol=1e-5, atol=1e-6, err_msg=path)


def _unsplittable(rank: int, world_size: int) -> str:
    # 61 rows by 16: a last global batch of 13, split 7 + 6 over the replicas: 7 rows do not split in 2
    return refusal(lambda: _fit_weights([("pipe", 2), ("batch", 2)], 61, 16, 2, 1))


@pytest.mark.timeout(TIMEOUT)
def test_a_batch_that_does_not_split_on_one_replica_is_refused_on_every_replica() -> None:
    for message in run_distributed(_unsplittable, world_size=4, timeout=TIMEOUT - 60):
        assert "does not split into microbatches=2" in message and "of 13 in all replicas" in message, message


def _overflow_once(model: Any) -> None:
    """Make the last layer's bias gradient infinite at the first backward only (an overflow in one stage)."""
    fired = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if fired:
            return grad
        fired.append(True)
        return torch.full_like(grad, float("inf"))

    model.module.head.bias.register_hook(hook)


def _float16_overflow(rank: int, world_size: int) -> dict[str, Any]:
    import meshfit as mf

    mf.mixed_precision.set_global_policy("mixed_float16")
    model = _model([("pipe", 2)], ["blocks.2"], microbatches=2)
    _overflow_once(model)
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return {"iterations": int(model.optimizer.iterations), "every": dict(zip(model.module.state_dict(),
                                                                              model.get_weights(), strict=True))}


@pytest.mark.timeout(TIMEOUT)
def test_an_overflow_in_one_stage_skips_the_step_on_every_stage() -> None:
    """Under ``mixed_float16`` one process skips a step whose gradients overflow anywhere; so does every stage
    (the last stage's overflow is agreed on, so the first stage does not apply its update alone)."""
    import meshfit as mf

    mf.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _model(None)
        _overflow_once(model)
        x, y = _data()
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    finally:
        mf.mixed_precision.set_global_policy("float32")
    weights = {k: v.detach().numpy() for k, v in model.module.state_dict().items()}
    for result in run_distributed(_float16_overflow, world_size=2, timeout=TIMEOUT - 60):
        assert result["iterations"] == int(model.optimizer.iterations)
        for path, value in result["every"].items():  # float16 rounds each microbatch alone (4.5e-5 measured); a
            # step applied by one stage alone moves its weights by about the learning rate, 0.01
            np.testing.assert_allclose(value, weights[path], rtol=1e-3, atol=2e-4, err_msg=path)


def _first_epoch(rank: int, world_size: int, backup: str, schedule: str, split_points: list[str],
                 stages_per_rank: int, epochs: int) -> dict[str, Any]:
    import meshfit as mf

    model = _model([("pipe", 2)], split_points, microbatches=4, schedule=schedule, stages_per_rank=stages_per_rank)
    x, y = _data()
    steps: list[int] = []
    history = model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=[mf.callbacks.BackupAndRestore(backup, delete_checkpoint=False),
                                   _counting(steps)])
    return {"history": history.history, "steps": len(steps),
            "every": _every(model)}


@pytest.mark.timeout(TIMEOUT)
def test_a_pipeline_backup_resumes_on_another_depth_and_in_one_plain_process(tmp_path: Any) -> None:
    """One epoch on 2 stages; the second resumed on 4 interleaved stages (another depth), and separately in
    one plain process: both end at one uninterrupted process's weights and logs."""
    import shutil

    import meshfit as mf

    weights, history, _ = _one_process()
    first = str(tmp_path / "first")
    run_distributed(_first_epoch, world_size=2, timeout=TIMEOUT - 60, args=(first, "1F1B", ["blocks.2"], 1, 1))
    other_depth = str(tmp_path / "other")
    shutil.copytree(first, other_depth)
    results = run_distributed(_first_epoch, world_size=2, timeout=TIMEOUT - 60,
                              args=(other_depth, "Interleaved1F1B", ["blocks.1", "blocks.2", "blocks.3"], 2, 2))
    for result in results:
        assert result["steps"] == 4  # the second epoch's 4 steps only: resumed, not trained again from the start
        np.testing.assert_allclose(result["history"]["loss"], history["loss"], rtol=1e-5)
        for path, value in result["every"].items():
            np.testing.assert_allclose(value, weights[path], rtol=1e-5, atol=1e-6, err_msg=path)
    model = _model(None)
    x, y = _data()
    steps: list[int] = []
    resumed = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                        callbacks=[mf.callbacks.BackupAndRestore(first, delete_checkpoint=False), _counting(steps)])
    assert len(steps) == 4
    np.testing.assert_allclose(resumed.history["loss"], history["loss"], rtol=1e-5)
    for path, value in model.module.state_dict().items():
        np.testing.assert_allclose(value.numpy(), weights[path], rtol=1e-5, atol=1e-6, err_msg=path)


def _refusals(rank: int, world_size: int) -> list[str]:
    import meshfit as mf

    class Custom(mf.Model):
        def train_step(self, data):
            return super().train_step(data)

    class Evaluating(mf.Model):
        def test_step(self, data):
            return super().test_step(data)

    class Measuring(mf.Model):
        def compute_metrics(self, x, y, y_pred, sample_weight=None):
            return super().compute_metrics(x, y, y_pred, sample_weight)

    x, y = _data()
    messages: list[str] = []
    built: list[Any] = []

    def refused(call: Any) -> None:
        try:
            call()
            messages.append("not refused")
        except ValueError as error:
            messages.append(str(error))

    for dims, kind, points, optimizer in (
            ([("pipe", 2)], Custom, ["blocks.2"], None), ([("pipe", 2)], Evaluating, ["blocks.2"], None),
            ([("pipe", 2)], Measuring, ["blocks.2"], None),
            ([("batch", 2)], mf.Model, ["blocks.2"], None),
            ([("pipe", 2)], mf.Model, ["blocks.1", "blocks.2", "blocks.3"], None),
            ([("pipe", 2)], mf.Model, ["blocks.2"], mf.optimizers.Adam(0.01, global_clipnorm=1.0))):
        def build_and_fit(dims: Any = dims, kind: Any = kind, points: Any = points, optimizer: Any = optimizer) -> None:
            built.append(_model(dims, points, microbatches=2, kind=kind, optimizer=optimizer or mf.optimizers.Adam(0.01)))
            built[-1].fit(x, y, batch_size=16, epochs=1, verbose=0)

        refused(build_and_fit)  # at model creation (a pipeline is placed then) or when fit starts
    # calling the model would run the other stages on copies this process never trains
    refused(functools.partial(built[-1], torch.from_numpy(x[:4])))
    return messages


@pytest.mark.timeout(TIMEOUT)
def test_a_pipeline_refuses_what_it_cannot_run_exactly() -> None:
    for override, evaluating, measuring, no_axis, count, clipnorm, call in run_distributed(
            _refusals, world_size=2, timeout=TIMEOUT - 60):
        assert "Invalid `train_step` override on Custom" in override and "layout_map.pipeline" in override, override
        assert "Invalid `test_step` override on Evaluating" in evaluating, evaluating
        assert "Invalid `compute_metrics` override on Measuring" in measuring and "wait for" in measuring, measuring
        assert "has no pipeline axis" in no_axis and "create_mesh([('pipe', 2)" in no_axis, no_axis
        assert "4 stages for a 'pipe' axis of 2" in count and "give 1 split points" in count, count
        assert "Invalid `global_clipnorm` under a pipeline" in clipnorm and "clipnorm" in clipnorm, clipnorm
        assert "under a pipeline" in call and "model.predict(x)" in call, call


def test_pipeline_bad_input_is_refused_naming_the_value() -> None:
    import meshfit as mf
    from meshfit.dtensor._pipeline import stage_paths

    mesh = mf.dtensor.Mesh(("pipe",), (2,))
    with pytest.raises(ValueError, match=r"Invalid `schedule`.*'ZeroBubble'"):
        mf.dtensor.LayoutMap(mesh).pipeline(["blocks.2"], microbatches=4, schedule="ZeroBubble")
    with pytest.raises(ValueError, match=r"Invalid `microbatches`.*microbatches=0"):
        mf.dtensor.LayoutMap(mesh).pipeline(["blocks.2"], microbatches=0)
    with pytest.raises(ValueError, match=r"Invalid `stages_per_rank=2` with schedule='1F1B'"):
        mf.dtensor.LayoutMap(mesh).pipeline(["blocks.2"], microbatches=2, stages_per_rank=2)
    with pytest.raises(ValueError, match=r"Invalid split point 'block.2'.*not a module path"):
        stage_paths(Classifier(), ["block.2"])
    tied = Classifier()
    tied.head = torch.nn.Linear(3, 16, bias=False)
    tied.head.weight = tied.tokens.weight  # an embedding and a head sharing one weight
    with pytest.raises(ValueError, match=r"tied weight 'tokens.weight' in stage 0 .*'head.weight' in stage 1"):
        stage_paths(tied, ["blocks.2"])
    stages = stage_paths(Classifier(), ["blocks.2"])
    assert "tokens.weight" in stages[0] and "blocks.1.fc.bias" in stages[0]
    assert "blocks.2.fc.weight" in stages[1] and "head.weight" in stages[1]
