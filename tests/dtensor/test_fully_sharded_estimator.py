"""The Estimator on fully sharded data parallel (issue 21): ``RunConfig(train_distribute=...)`` with the
strategy ``LayoutMap.fully_sharded(mesh).scope()`` yields.

On 2 gloo processes, each reading half of every global batch of 8 (``input_fn`` shards by its
`InputContext`, per-replica batch 4): training equals one plain process on the same global batches
(SGD, 10 steps, resumed from a checkpoint at step 5 by a new Estimator), each process holds half of
each weight, checkpoints are DCP shards, ``evaluate`` and ``predict`` work on the sharded weights, and
a plain process evaluates the sharded run's checkpoint.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from tests._multiproc import run_distributed

GLOBAL_BATCH, STEPS, EXAMPLES = 8, 10, 80


def _data():
    rng = np.random.default_rng(5)
    return rng.normal(size=(EXAMPLES, 8)).astype("float32"), rng.integers(0, 4, size=(EXAMPLES,)).astype("int64")


def _fns(replicas, modules, examples=EXAMPLES):
    import meshfit as mf
    from meshfit.estimator import EstimatorSpec, ModeKeys, once

    x, y = (a[:examples] for a in _data())
    batch = GLOBAL_BATCH // replicas  # the per-replica batch, as in TF's Estimator

    def input_fn(mode, input_context=None):
        ds = mf.data.Dataset.from_tensor_slices(x if mode == ModeKeys.PREDICT else (x, y))
        if input_context is not None:  # rows 0, 2, 4, 6 and 1, 3, 5, 7 of each global batch of 8
            ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return ds.batch(batch)

    def model_fn(features, labels, mode):
        model = once(lambda: nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)))
        if not modules:
            modules.append(model)
        logits = model(features)
        if mode == ModeKeys.PREDICT:
            return EstimatorSpec(mode, predictions={"logits": logits})
        loss = nn.functional.cross_entropy(logits, labels, reduction="sum") * (1.0 / batch)
        if mode == ModeKeys.EVAL:
            return EstimatorSpec(mode, loss=loss)
        optimizer = once(lambda: mf.optimizers.SGD(learning_rate=0.1))
        return EstimatorSpec(mode, loss=loss, train_op=optimizer.minimize(loss, mf.estimator.get_or_create_global_step()))

    return input_fn, model_fn


def _run(rank, world, sharded, model_dir):
    """Train 5 steps, then a new Estimator on the same model_dir resumes to 10; evaluate and predict."""
    from torch.distributed.tensor import DTensor

    import meshfit as mf
    from meshfit.estimator import Estimator, RunConfig

    replicas = world if sharded else 1
    if sharded:
        with mf.dtensor.LayoutMap.fully_sharded(mf.dtensor.create_mesh([("batch", world)])).scope() as strategy:
            pass  # the strategy of a fully sharded map, given to the Estimator as TF's train_distribute
    else:
        strategy = None
    config = RunConfig(train_distribute=strategy, tf_random_seed=0, save_checkpoints_steps=5,
                       log_step_count_steps=None, save_summary_steps=None)
    input_fn, model_fn = _fns(replicas, [])
    Estimator(model_fn, model_dir=model_dir, config=config).train(input_fn, max_steps=5)
    modules: list = []
    input_fn, model_fn = _fns(replicas, modules)
    estimator = Estimator(model_fn, model_dir=model_dir, config=config)
    estimator.train(input_fn, max_steps=STEPS)  # restores step 5 (weights, optimizer, data position)
    weight = modules[0][0].weight
    local = tuple(weight.to_local().shape) if isinstance(weight, DTensor) else tuple(weight.shape)
    weights = {name: estimator.get_variable_value(name) for name in estimator.get_variable_names()}
    evaluated = estimator.evaluate(input_fn)
    predicted = np.stack([p["logits"] for p in estimator.predict(input_fn)])
    return weights, local, evaluated, predicted


def _evaluate_alone(rank, world, model_dir):
    from meshfit.estimator import Estimator, RunConfig

    input_fn, model_fn = _fns(1, [])
    return Estimator(model_fn, model_dir=model_dir, config=RunConfig(log_step_count_steps=None)).evaluate(input_fn)


def test_estimator_on_two_fully_sharded_processes_equals_one_plain_process(tmp_path):
    plain_dir, sharded_dir = str(tmp_path / "plain"), str(tmp_path / "sharded")
    plain = run_distributed(_run, world_size=1, args=(False, plain_dir), timeout=300)[0]
    sharded = run_distributed(_run, world_size=2, args=(True, sharded_dir), timeout=300)
    assert int(plain[0]["global_step"]) == STEPS
    for weights, local, evaluated, predicted in sharded:
        assert local == (16, 8)  # each process holds half of the first weight's rows
        assert sorted(weights) == sorted(plain[0])
        for name, want in plain[0].items():
            got = weights[name]
            assert float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-12)) <= 1e-5, name
        assert evaluated["global_step"] == STEPS
        np.testing.assert_allclose(evaluated["loss"], plain[2]["loss"], rtol=1e-5)
        assert predicted.shape == (EXAMPLES, 4)
        np.testing.assert_allclose(predicted, plain[3], rtol=1e-4, atol=1e-6)
    initial = plain[0]["0.weight"]
    torch.manual_seed(0)
    assert float(np.max(np.abs(initial - nn.Linear(8, 32).weight.detach().numpy()))) > 1e-3  # it trained
    shards = sorted(f for f in os.listdir(os.path.join(sharded_dir, "model.ckpt-10")) if f.endswith(".distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # DCP: each process wrote its own shards
    alone = run_distributed(_evaluate_alone, world_size=1, args=(sharded_dir,), timeout=300)[0]
    assert alone["global_step"] == STEPS  # the sharded checkpoint, read whole by a plain process
    np.testing.assert_allclose(alone["loss"], plain[2]["loss"], rtol=1e-5)


def _torch_optimizer(rank, world, model_dir):
    import meshfit as mf
    from meshfit.estimator import Estimator, EstimatorSpec, RunConfig, minimize, once

    input_fn, _ = _fns(world, [])

    def model_fn(features, labels, mode):
        model = once(lambda: nn.Linear(8, 4))
        optimizer = once(lambda: torch.optim.SGD(model.parameters(), lr=0.1))  # built on unsharded parameters
        loss = nn.functional.cross_entropy(model(features), labels)
        return EstimatorSpec(mode, loss=loss, train_op=minimize(optimizer, loss))

    with mf.dtensor.LayoutMap.fully_sharded(mf.dtensor.create_mesh([("batch", world)])).scope() as strategy:
        config = RunConfig(train_distribute=strategy, log_step_count_steps=None, save_checkpoints_steps=1)
    try:
        Estimator(model_fn, model_dir=model_dir, config=config).train(input_fn, max_steps=2)
    except ValueError as error:
        return str(error), sorted(os.listdir(model_dir)) if os.path.isdir(model_dir) else []
    return "trained", None


def test_a_torch_optimizer_built_before_sharding_is_refused_before_any_step(tmp_path):
    message, written = run_distributed(_torch_optimizer, world_size=1, args=(str(tmp_path / "m"),), timeout=120)[0]
    assert "Invalid optimizer for LayoutMap.fully_sharded: a SGD built on the module's parameters" in message
    assert "mf.optimizers.SGD(0.1)" in message
    assert not [name for name in written if name.startswith("model.ckpt")]


def _train_uneven(rank, world, kind, model_dir):
    """77 examples: the last batch is 3 rows on rank 0, 2 on rank 1."""
    import meshfit as mf
    from meshfit.estimator import Estimator, RunConfig

    if kind == "sharded":
        with mf.dtensor.LayoutMap.fully_sharded(mf.dtensor.create_mesh([("batch", world)])).scope() as strategy:
            pass
    else:
        strategy = mf.MultiWorkerMirroredStrategy()
    config = RunConfig(train_distribute=strategy, tf_random_seed=0, log_step_count_steps=None,
                       save_summary_steps=None)
    input_fn, model_fn = _fns(world, [], examples=77)
    estimator = Estimator(model_fn, model_dir=model_dir, config=config).train(input_fn)
    return {name: estimator.get_variable_value(name) for name in estimator.get_variable_names()}


def test_an_uneven_last_batch_averages_the_replicas_gradients_as_the_mirrored_estimator_does(tmp_path):
    # TF's Estimator semantics: each replica's gradient counts 1/N whatever its batch (not its share of
    # the global batch, as fit weighs it); fully sharded reduce-scatters exactly like the mirrored all-reduce.
    mirrored = run_distributed(_train_uneven, world_size=2, args=("mirrored", str(tmp_path / "m")), timeout=300)[0]
    sharded = run_distributed(_train_uneven, world_size=2, args=("sharded", str(tmp_path / "s")), timeout=300)[0]
    assert int(sharded["global_step"]) == int(mirrored["global_step"]) == STEPS
    for name, want in mirrored.items():
        np.testing.assert_allclose(sharded[name], want, rtol=1e-5, atol=1e-7, err_msg=name)
