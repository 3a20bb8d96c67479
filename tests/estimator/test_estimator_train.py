"""`Estimator.train` / ``evaluate`` / ``predict`` in one process; seed 002's fault-tolerance flow."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
from _interrupt import InterruptHook
from torch import nn

import meshfit as mf
from meshfit.estimator import (
    Estimator,
    EstimatorSpec,
    ModeKeys,
    RunConfig,
    SessionRunArgs,
    SessionRunHook,
    StopAtStepHook,
    once,
)


def _kept(directory) -> list[str]:
    """The checkpoints a reader sees (final names; pruned ones may linger a moment as ``*.deleting``)."""
    return sorted(n for n in os.listdir(directory) if re.fullmatch(r"model\.ckpt-\d+", n))

RNG = np.random.default_rng(0)
X = RNG.normal(size=(96, 4)).astype(np.float32)
Y = (X[:, 0] + X[:, 1] > 0).astype(np.int64)
BATCH_SIZE = 8


def input_fn(mode, input_context=None):
    ds = mf.data.Dataset.from_tensor_slices((X, Y))
    if mode == ModeKeys.TRAIN:
        ds = ds.shuffle(96, seed=1).repeat()
    return ds.batch(BATCH_SIZE)


def finite_input_fn(mode):
    return mf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH_SIZE)  # 12 batches


def model_fn(features, labels, mode):
    model = once(lambda: nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)))
    logits = model(features)
    if mode == ModeKeys.PREDICT:
        return EstimatorSpec(mode, predictions={"logits": logits, "classes": logits.argmax(1)})
    optimizer = once(lambda: mf.optimizers.Adam(learning_rate=0.05))
    loss = nn.functional.cross_entropy(logits, labels, reduction="sum") * (1.0 / BATCH_SIZE)
    if mode == ModeKeys.EVAL:
        accuracy = mf.metrics.SparseCategoricalAccuracy()  # a new metric per call is fine
        accuracy.update_state(labels, logits)
        return EstimatorSpec(mode, loss=loss, eval_metric_ops={"accuracy": accuracy})
    return EstimatorSpec(mode, loss=loss, train_op=optimizer.minimize(loss, mf.estimator.get_global_step()))


def _estimator(model_dir, **config):
    config.setdefault("log_step_count_steps", None)
    return Estimator(model_fn, model_dir=str(model_dir), config=RunConfig(tf_random_seed=0, **config))


class RecordSteps(SessionRunHook):
    def __init__(self):
        self.events, self.steps, self.losses = [], [], []

    def begin(self):
        self.events.append("begin")

    def after_create_session(self, session, coord):
        self.events.append(f"after_create_session@{session.global_step}")

    def before_run(self, run_context):
        return SessionRunArgs({"step": "global_step", "loss": "loss"})

    def after_run(self, run_context, run_values):
        self.steps.append(run_values.results["step"])
        self.losses.append(run_values.results["loss"])

    def end(self, session):
        self.events.append(f"end@{session.global_step}")


def _weights(estimator):
    return {name: estimator.get_variable_value(name) for name in estimator.get_variable_names()}


def test_train_evaluate_predict(tmp_path):
    estimator = _estimator(tmp_path, save_checkpoints_steps=5)
    with pytest.raises(ValueError, match="Could not find trained model"):
        estimator.evaluate(finite_input_fn)
    record = RecordSteps()
    assert estimator.train(input_fn, steps=30, hooks=[record]) is estimator
    assert record.events == ["begin", "after_create_session@0", "end@30"]
    assert record.steps == list(range(1, 31))
    assert np.mean(record.losses[-5:]) < 0.6 * np.mean(record.losses[:5])
    results = estimator.evaluate(finite_input_fn)
    assert set(results) == {"loss", "accuracy", "global_step"} and results["global_step"] == 30
    predictions = list(estimator.predict(finite_input_fn))
    logits = np.stack([p["logits"] for p in predictions])
    assert len(predictions) == len(X) and sorted(predictions[0]) == ["classes", "logits"]
    assert results["accuracy"] == pytest.approx(np.mean(logits.argmax(1) == Y))
    # TF's loss: the mean of the batches' losses
    with torch.no_grad():
        model = estimator._caller.modules["sequential"]
        batch_losses = [nn.functional.cross_entropy(model(torch.from_numpy(X[i:i + 8])), torch.from_numpy(Y[i:i + 8]),
                                                    reduction="sum") / 8 for i in range(0, 96, 8)]
    assert results["loss"] == pytest.approx(float(torch.stack(batch_losses).mean()), rel=1e-6)
    names = estimator.get_variable_names()
    assert names == ["0.bias", "0.weight", "2.bias", "2.weight", "global_step"]
    np.testing.assert_array_equal(estimator.get_variable_value("0.weight"), model[0].weight.detach().numpy())
    assert int(estimator.get_variable_value("global_step")) == 30
    with pytest.raises(ValueError, match="is not a variable"):
        estimator.get_variable_value("dense/kernel")


def test_training_without_limits_ends_with_the_input_and_continues_on_the_next_pass(tmp_path):
    estimator = _estimator(tmp_path, save_checkpoints_steps=100)
    estimator.train(finite_input_fn)
    assert estimator.latest_checkpoint().endswith("model.ckpt-12")  # one pass: 12 batches, saved at the end
    estimator.train(finite_input_fn, steps=5)
    assert estimator.latest_checkpoint().endswith("model.ckpt-17")
    every_4 = tmp_path / "every_4"
    _estimator(every_4, save_checkpoints_steps=4).train(input_fn, steps=6)
    _estimator(every_4, save_checkpoints_steps=4).train(input_fn, steps=3)  # resumes at 6: saves at 8, and 9 at the end
    assert _kept(every_4) == ["model.ckpt-0", "model.ckpt-4", "model.ckpt-6", "model.ckpt-8", "model.ckpt-9"]


def _logged(capfd, caplog) -> str:
    """The estimator's INFO lines: on stderr, or in logging when a handler is set up (pytest sets one)."""
    return capfd.readouterr().err + caplog.text


def test_max_steps_below_the_global_step_returns_at_once(tmp_path, capfd, caplog):
    caplog.set_level("INFO", logger="meshfit.estimator")
    _estimator(tmp_path, save_checkpoints_steps=5).train(input_fn, max_steps=10)
    estimator = _estimator(tmp_path, save_checkpoints_steps=5)
    record = RecordSteps()
    estimator.train(input_fn, max_steps=4, hooks=[record])
    assert "Skipping training since max_steps has already saved" in _logged(capfd, caplog)
    assert record.steps == [] and estimator.latest_checkpoint().endswith("model.ckpt-10")
    with pytest.raises(ValueError, match="give one of them"):
        estimator.train(input_fn, steps=1, max_steps=20)
    with pytest.raises(ValueError, match="Invalid `steps`"):
        estimator.train(input_fn, steps=0)


def test_stop_at_step_hook_log_lines_and_summaries(tmp_path, capfd, caplog):
    caplog.set_level("INFO", logger="meshfit.estimator")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    estimator = _estimator(tmp_path, save_checkpoints_steps=100, log_step_count_steps=2, save_summary_steps=3)
    estimator.train(input_fn, hooks=[StopAtStepHook(last_step=7)])
    assert estimator.latest_checkpoint().endswith("model.ckpt-7")
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [3, 6]
    assert [e.step for e in events.Scalars("global_step/sec")] == [3, 6]
    err = _logged(capfd, caplog)
    assert "loss = " in err and ", step = 0" in err and ", step = 6 (" in err and "global_step/sec: " in err
    assert "Saving checkpoints for 0 into" in err and "Saving checkpoints for 7 into" in err
    assert "Loss for final step: " in err


def test_seed_002_flow_a_hook_raises_at_step_5_and_a_rebuilt_estimator_continues(tmp_path):
    """Seed 002: a checkpoint every step; a hook raising at step 5; a new Estimator continues from model_dir.

    The final weights are bitwise those of an uninterrupted run, and keep_checkpoint_max holds.
    """
    reference = _estimator(tmp_path / "reference", save_checkpoints_steps=1, keep_checkpoint_max=3)
    reference.train(input_fn, max_steps=10)

    path = tmp_path / "interrupted"
    classifier = _estimator(path, save_checkpoints_steps=1, keep_checkpoint_max=3)
    with pytest.raises(RuntimeError, match="Interruption"):
        classifier.train(input_fn, hooks=[InterruptHook()], max_steps=10)
    # the hook raised in the sixth step's after_run, before that step's checkpoint: step 5 is the last
    assert classifier.latest_checkpoint().endswith("model.ckpt-5")
    kept = _kept(path)
    assert kept == ["model.ckpt-3", "model.ckpt-4", "model.ckpt-5"]

    classifier = _estimator(path, save_checkpoints_steps=1, keep_checkpoint_max=3)
    record = RecordSteps()
    classifier.train(input_fn, max_steps=10, hooks=[record])
    assert record.events[1] == "after_create_session@5" and record.steps == [6, 7, 8, 9, 10]
    kept = _kept(path)
    assert kept == ["model.ckpt-10", "model.ckpt-8", "model.ckpt-9"]
    expected, resumed = _weights(reference), _weights(classifier)
    assert expected.keys() == resumed.keys()
    for name in expected:
        np.testing.assert_array_equal(resumed[name], expected[name], err_msg=name)


def test_train_and_evaluate_locally_evaluates_at_each_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    estimator = _estimator(tmp_path, save_checkpoints_steps=4)
    result, exports = mf.estimator.train_and_evaluate(
        estimator, mf.estimator.TrainSpec(input_fn, max_steps=12),
        mf.estimator.EvalSpec(finite_input_fn, steps=3, throttle_secs=0))
    assert exports == [] and result["global_step"] == 12 and set(result) == {"loss", "accuracy", "global_step"}
    events = EventAccumulator(str(tmp_path / "eval"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [4, 8, 12]
    assert events.Scalars("loss")[-1].value == pytest.approx(result["loss"], rel=1e-6)
    # One event file per directory: torch numbers new files without zero-padding, so files made within
    # a second by a process that had made 10 before sorted later steps first (TensorBoard reads by name).
    assert len([f for f in os.listdir(tmp_path / "eval") if f.startswith("events.out.tfevents")]) == 1
    assert len([f for f in os.listdir(tmp_path) if f.startswith("events.out.tfevents")]) == 1


def test_train_and_evaluate_needs_checkpoints_locally(tmp_path):
    estimator = _estimator(tmp_path, save_checkpoints_steps=None, save_checkpoints_secs=None)
    with pytest.raises(ValueError, match="saves none"):
        mf.estimator.train_and_evaluate(estimator, mf.estimator.TrainSpec(input_fn, max_steps=2),
                                        mf.estimator.EvalSpec(finite_input_fn))


def test_keep_checkpoint_max_zero_keeps_all_and_a_users_saver_hook_replaces_the_default(tmp_path):
    estimator = _estimator(tmp_path / "all", save_checkpoints_steps=2, keep_checkpoint_max=0)
    estimator.train(input_fn, max_steps=8)
    assert _kept(tmp_path / "all") == [
        f"model.ckpt-{s}" for s in (0, 2, 4, 6, 8)]

    class Listener(mf.estimator.CheckpointSaverListener):
        def __init__(self):
            self.saved = []

        def after_save(self, session, global_step_value):
            self.saved.append(global_step_value)
            return global_step_value >= 6  # a listener may stop training

    listener = Listener()
    estimator = _estimator(tmp_path / "model", save_checkpoints_steps=1)
    hook = mf.estimator.CheckpointSaverHook(str(tmp_path / "mine"), save_steps=3, listeners=[listener])
    estimator.train(input_fn, max_steps=20, hooks=[hook])
    assert listener.saved == [0, 3, 6]
    assert sorted(os.listdir(tmp_path / "mine")) == ["checkpoint", "model.ckpt-0", "model.ckpt-3", "model.ckpt-6"]
    assert not os.path.exists(tmp_path / "model") or _kept(tmp_path / "model") == []


def test_seed_002_resume_with_the_seeds_unseeded_shuffle_is_exact(tmp_path):
    """Each input_fn call draws a new shuffle seed; the resumed Estimator reads the order it saved."""
    import json

    from _procs import ROOT, child_env, finish, start

    script = os.path.join(ROOT, "tests", "scripts", "estimator_seed002.py")
    results, outputs = {}, {}
    for mode in ("uninterrupted", "interrupted"):
        code, out = finish(start([script, mode, str(tmp_path / mode)], child_env()), timeout=240)
        assert code == 0, out
        outputs[mode], results[mode] = out, json.loads(out.strip().splitlines()[-1])
    assert "raised: Interruption" in outputs["interrupted"]
    assert results["uninterrupted"]["global_step"] == results["interrupted"]["global_step"] == 10
    assert results["uninterrupted"] == results["interrupted"]
