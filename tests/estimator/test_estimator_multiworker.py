"""The Estimator on several workers: seed 001's program over TF_CONFIG and `meshfit launch --evaluator`,
N replicas == one process on the global batch, and a worker killed during `train_and_evaluate`.

The launched jobs fork their tasks from one preloaded process (``--preload``: torch imported once, not
once a task); the program's workers start as new interpreters under torchrun below.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch
from _multiproc import run_distributed
from _procs import ROOT, child_env, finish, free_ports, start, tf_config

SCRIPT = os.path.join(ROOT, "examples", "estimator_multiworker.py")
QUICK = ["--learning-rate", "0.1", "--train-examples", "1024", "--eval-steps", "2", "--throttle-secs", "0",
         "--start-delay-secs", "0"]


def _kept(directory) -> list[str]:
    """The checkpoints a reader sees (final names; pruned ones may linger a moment as ``*.deleting``)."""
    return sorted(n for n in os.listdir(directory) if re.fullmatch(r"model\.ckpt-\d+", n))


def _losses(output: str) -> list[float]:
    return [float(v) for v in re.findall(r"loss = ([0-9.]+), step = \d+", output)]


def _results(prefix: str, task: str) -> dict:
    with open(f"{prefix}.{task}.json") as file:
        return json.load(file)


def test_seed_001_program_on_two_workers_over_tf_config(tmp_path):
    ports = free_ports(2)
    model_dir, prefix = str(tmp_path / "multiworker"), str(tmp_path / "results")
    argv = [SCRIPT, "--model-dir", model_dir, "--results", prefix, "--log-steps", "1",
            "--save-checkpoints-steps", "4", *QUICK]
    procs = [start(argv, child_env(TF_CONFIG=tf_config(ports, i))) for i in range(2)]
    outputs = [finish(p, timeout=420) for p in procs]
    for code, out in outputs:
        assert code == 0, out
    losses = _losses(outputs[0][1])
    assert len(losses) == 8, outputs[0][1]  # 1024 examples, sharded over 2 workers, 64 per batch: 8 steps
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.02, losses
    assert _losses(outputs[1][1]) == []  # only the chief logs
    for task in ("worker0", "worker1"):
        results = _results(prefix, task)
        assert results["evaluate"]["global_step"] == 8 and set(results["evaluate"]) == {"loss", "global_step"}
        assert results["evaluate"]["loss"] < losses[0]
        assert results["predictions"] == {"count": 359, "keys": ["logits"], "logits_shape": [10]}
    assert _kept(model_dir) == [
        "model.ckpt-0", "model.ckpt-4", "model.ckpt-8"]


class _WithUnused(torch.nn.Module):
    """A regression whose second layer is never used: it must get no gradient (and no weight decay)."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_seed_001_program_under_torchrun(tmp_path):
    model_dir, prefix = str(tmp_path / "multiworker"), str(tmp_path / "results")
    (port,) = free_ports(1)
    proc = start(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                  "--master-port", str(port), SCRIPT, "--model-dir", model_dir, "--results", prefix,
                  "--save-checkpoints-steps", "4", *QUICK], child_env())
    code, out = finish(proc, timeout=420)
    assert code == 0, out
    for task in ("worker0", "worker1"):
        results = _results(prefix, task)
        assert results["evaluate"]["global_step"] == 8 and results["predictions"]["keys"] == ["logits"]
    assert _kept(model_dir) == ["model.ckpt-0", "model.ckpt-4", "model.ckpt-8"]


def _regression(world: int):
    """A linear regression whose input_fn shards by InputContext; 8 examples per step in all."""
    import meshfit as mf
    from meshfit.estimator import EstimatorSpec, ModeKeys, once

    x = np.random.default_rng(0).normal(size=(48, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32)).reshape(-1, 1)
    batch = 8 // world  # the per-replica batch

    def input_fn(mode, input_context=None):
        ds = mf.data.Dataset.from_tensor_slices((x, y))
        if input_context:
            ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return ds.batch(batch)

    def model_fn(features, labels, mode):
        model = once(_WithUnused)
        loss = ((model(features) - labels) ** 2).sum() * (1.0 / batch)  # the seed's loss: sum / per-replica batch
        if mode == ModeKeys.EVAL:
            return EstimatorSpec(mode, loss=loss)
        optimizer = once(lambda: mf.optimizers.SGD(learning_rate=0.05, weight_decay=0.1))
        return EstimatorSpec(mode, loss=loss, train_op=optimizer.minimize(loss))

    return input_fn, model_fn


def _train_replicated(rank: int, world: int, model_dir: str) -> dict:
    import meshfit as mf
    from meshfit.estimator import Estimator, RunConfig

    input_fn, model_fn = _regression(world)
    strategy = mf.MultiWorkerMirroredStrategy()
    config = RunConfig(train_distribute=strategy, tf_random_seed=0, save_checkpoints_steps=3,
                       log_step_count_steps=None)
    estimator = Estimator(model_fn, model_dir=model_dir, config=config)
    estimator.train(input_fn)
    return {name: estimator.get_variable_value(name) for name in estimator.get_variable_names()}


def _stop_and_evaluate(rank: int, world: int, model_dir: str) -> dict:
    import torch.distributed as dist

    import meshfit as mf
    from meshfit.estimator import Estimator, RunConfig, StopAtStepHook

    input_fn, model_fn = _regression(world)
    strategy = mf.MultiWorkerMirroredStrategy()
    config = RunConfig(train_distribute=strategy, eval_distribute=strategy, tf_random_seed=0,
                       save_checkpoints_steps=100, log_step_count_steps=None)
    estimator = Estimator(model_fn, model_dir=model_dir, config=config)
    estimator.train(input_fn, hooks=[StopAtStepHook(last_step=4)])
    distributed = estimator.evaluate(input_fn)  # both replicas, each on its shard, reduced
    local = None
    if rank == 0:  # one worker evaluating by itself: no collective, so no hang
        alone = Estimator(model_fn, model_dir=model_dir, config=config.replace(eval_distribute=None))
        local = alone.evaluate(input_fn)
    dist.barrier()
    return {"step": estimator.latest_checkpoint().rsplit("-", 1)[1], "distributed": distributed, "local": local}


def test_two_replicas_train_as_one_process_on_the_global_batch(tmp_path):
    single = run_distributed(_train_replicated, world_size=1, args=(str(tmp_path / "one"),), timeout=240)[0]
    both = run_distributed(_train_replicated, world_size=2, args=(str(tmp_path / "two"),), timeout=240)
    assert int(single["global_step"]) == 6 and int(both[0]["global_step"]) == 6
    # the unused layer got no gradient anywhere, so weight decay never touched it (it would, given zeros)
    torch.manual_seed(0)
    initial = _WithUnused()
    np.testing.assert_array_equal(both[0]["unused.weight"], initial.unused.weight.detach().numpy())
    for name in single:
        np.testing.assert_allclose(both[0][name], single[name], rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_array_equal(both[0][name], both[1][name])


def test_stop_at_step_and_distributed_or_lone_evaluation_on_two_replicas(tmp_path):
    results = run_distributed(_stop_and_evaluate, world_size=2, args=(str(tmp_path / "model"),), timeout=240)
    assert [r["step"] for r in results] == ["4", "4"]
    assert results[0]["distributed"] == results[1]["distributed"]
    assert results[0]["distributed"]["global_step"] == results[0]["local"]["global_step"] == 4
    assert results[0]["distributed"]["loss"] == pytest.approx(results[0]["local"]["loss"], rel=1e-6)


def _evaluations(model_dir: str) -> list[tuple[int, str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(model_dir, "eval"), size_guidance={"tensors": 0})
    events.Reload()
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors("checkpoint_path/text_summary")]


def test_seed_001_program_under_meshfit_launch_with_an_evaluator(tmp_path):
    model_dir, prefix = str(tmp_path / "multiworker"), str(tmp_path / "results")
    proc = start(["-m", "meshfit._cli", "launch", "--workers", "2", "--evaluator", "--preload", SCRIPT, "--model-dir",
                  model_dir, "--results", prefix, "--save-checkpoints-steps", "2", *QUICK], child_env())
    code, out = finish(proc, timeout=420)
    assert code == 0, out
    assert "[evaluator 0] INFO:meshfit.estimator:Saving dict for global step 8: global_step = 8, loss = " in out, out
    evaluator = _results(prefix, "evaluator0")["train_and_evaluate"]
    assert evaluator["global_step"] == 8 and set(evaluator) == {"loss", "global_step"}
    evaluations = _evaluations(model_dir)
    assert evaluations[-1][0] == 8
    for step, path in evaluations:  # what TensorBoard reads: each result at its checkpoint's step
        assert os.path.basename(path) == f"model.ckpt-{step}"


@pytest.mark.slow
def test_a_worker_killed_during_train_and_evaluate_restarts_and_the_evaluator_reads_only_whole_checkpoints(tmp_path):
    model_dir, prefix = str(tmp_path / "multiworker"), str(tmp_path / "results")
    proc = start(["-m", "meshfit._cli", "launch", "--workers", "2", "--evaluator", "--max-restarts", "1", "--preload",
                  SCRIPT, "--model-dir", model_dir, "--results", prefix, "--save-checkpoints-steps", "1",
                  "--keep-checkpoint-max", "2", "--kill-worker-at-step", "5", *QUICK], child_env())
    code, out = finish(proc, timeout=600)
    assert code == 0, out
    assert "worker 1 exited with code -9; restarting the group" in out, out
    assert "Restoring parameters from " in out and "Traceback" not in out, out
    for task in ("worker0", "worker1", "evaluator0"):
        results = _results(prefix, task)
        final = results["train_and_evaluate"] if task == "evaluator0" else results["evaluate"]
        assert final["global_step"] == 8, (task, results)
    evaluations = _evaluations(model_dir)
    assert evaluations and evaluations[-1][0] == 8
    for step, path in evaluations:
        assert os.path.basename(path) == f"model.ckpt-{step}"
    kept = _kept(model_dir)
    assert kept == ["model.ckpt-7", "model.ckpt-8"]


def test_mirrored_strategy_from_a_plain_python_process(tmp_path):
    code, out = finish(start([os.path.join(ROOT, "tests", "scripts", "estimator_mirrored.py"), str(tmp_path / "m")],
                             child_env()), timeout=300)
    assert code == 0, out
    # the two processes' lines may interleave on one line of the captured output: match each whole
    lines = sorted(re.findall(r"replica (\d) of 2: step (\d+) weight (\[\[.*?\]\])", out))
    assert [(r, s) for r, s, _ in lines] == [("0", "6"), ("1", "6")], out  # 48 examples, 2 x 4 per step
    assert lines[0][2] == lines[1][2]
    # train_and_evaluate ran TF's local loop (not the cluster path, which evaluates nowhere here)
    assert sorted(re.findall(r"replica (\d) evaluated at step (\w+)", out)) == [("0", "6"), ("1", "6")], out


def test_the_example_as_shipped_evaluates_under_meshfit_launch_with_an_evaluator(tmp_path):
    """The example's own delays (start_delay_secs=120, throttle_secs=600) and the launcher's default
    --evaluator-timeout (60 s): the evaluator still evaluates the final checkpoint before it is stopped."""
    model_dir = str(tmp_path / "multiworker")
    proc = start(["-m", "meshfit._cli", "launch", "--workers", "2", "--evaluator", "--preload", SCRIPT, "--model-dir",
                  model_dir, "--learning-rate", "0.1", "--train-examples", "1024", "--eval-steps", "2"], child_env())
    code, out = finish(proc, timeout=420)
    assert code == 0, out
    assert "[evaluator 0] evaluator 0: evaluation of the final checkpoint: {" in out, out
    assert "'global_step': 8" in out.split("evaluation of the final checkpoint:")[1], out
    assert "still running after" not in out, out  # not stopped by the launcher before evaluating
    assert "(None, [])" not in out, out
