"""mf.estimator.model_to_estimator: a compiled mf.Model becomes an Estimator that trains, evaluates and predicts
as the equivalent hand-written model_fn does, in one process and on 2 workers with train_and_evaluate."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from _multiproc import run_distributed
from torch import nn

import meshfit as mf
from meshfit.estimator import EstimatorSpec, ModeKeys, RunConfig, model_to_estimator

X = np.random.default_rng(0).normal(size=(48, 4)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5, 0.0], np.float32)).reshape(-1, 1)


def _input_fn(batch: int):
    def input_fn(mode, input_context=None):
        ds = mf.data.Dataset.from_tensor_slices((X, Y))
        if input_context:
            ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return ds.batch(batch)

    return input_fn


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _compiled_model() -> mf.Model:
    model = mf.Model(_module())
    model.compile(optimizer=mf.optimizers.SGD(learning_rate=0.05, momentum=0.5), loss="mse", metrics=["mae"])
    return model


def _hand_written_model_fn():
    """What model_to_estimator should amount to, written out: the same module, loss, optimizer and metric."""
    module = _module()
    optimizer = mf.optimizers.SGD(learning_rate=0.05, momentum=0.5)

    def model_fn(features, labels, mode):
        predictions = module(features)
        if mode == ModeKeys.PREDICT:
            return EstimatorSpec(mode, predictions=predictions)
        loss = ((predictions - labels) ** 2).mean()
        if mode == ModeKeys.EVAL:
            mae = mf.metrics.MeanAbsoluteError(name="mae")
            mae.update_state(labels, predictions.detach())
            return EstimatorSpec(mode, loss=loss, eval_metric_ops={"mae": mae})
        return EstimatorSpec(mode, loss=loss, train_op=optimizer.minimize(loss))

    return model_fn


def _config(**kwargs) -> RunConfig:
    return RunConfig(tf_random_seed=0, log_step_count_steps=None, **kwargs)


def test_it_trains_evaluates_and_predicts_as_the_hand_written_model_fn(tmp_path):
    model = _compiled_model()
    before = copy.deepcopy(model.module.state_dict())
    converted = model_to_estimator(keras_model=model, model_dir=str(tmp_path / "converted"), config=_config())
    by_hand = mf.estimator.Estimator(_hand_written_model_fn(), model_dir=str(tmp_path / "by_hand"), config=_config())
    for estimator in (converted, by_hand):
        estimator.train(_input_fn(8), steps=5)
    results, expected = converted.evaluate(_input_fn(8)), by_hand.evaluate(_input_fn(8))
    assert set(results) == {"loss", "mae", "global_step"} and results["global_step"] == 5
    assert results["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert results["mae"] == pytest.approx(expected["mae"], rel=1e-6)
    with torch.no_grad():
        initial_loss = float(((model.module(torch.from_numpy(X)) - torch.from_numpy(Y)) ** 2).mean())
    assert results["loss"] < initial_loss - 0.1  # it trained
    for name, value in model.module.state_dict().items():  # the Estimator trains a copy, as TF's
        assert torch.equal(value, before[name]), name
    predictions = list(converted.predict(_input_fn(8)))
    assert len(predictions) == 48 and np.shape(predictions[0]) == (1,)
    np.testing.assert_allclose(np.stack(predictions), np.stack(list(by_hand.predict(_input_fn(8)))), rtol=1e-6)


def test_an_uncompiled_model_is_refused():
    with pytest.raises(ValueError, match=r"has not been compiled yet\. Please compile the model with "
                                         r"`model.compile\(\)` before calling `model_to_estimator\(\)`"):
        model_to_estimator(keras_model=mf.Model(nn.Linear(4, 1)))


def test_model_or_path_and_other_arguments_are_checked(tmp_path):
    model = _compiled_model()
    with pytest.raises(ValueError, match=r"Either `keras_model` or `keras_model_path` needs to be provided"):
        model_to_estimator()
    with pytest.raises(ValueError, match=r"but not both"):
        model_to_estimator(keras_model=model, keras_model_path=str(tmp_path / "m"))
    with pytest.raises(TypeError, match=r"expected a compiled meshfit.Model, received Linear"):
        model_to_estimator(keras_model=nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r'Checkpoint format must be one of "checkpoint" or "saver"'):
        model_to_estimator(keras_model=model, checkpoint_format="h5")
    with pytest.raises(ValueError, match=r"metric names \['mae'\] are missing"):
        model_to_estimator(keras_model=model, metric_names_map={"other": "x"})
    with pytest.raises(ValueError, match=r"custom_objects="):
        model_to_estimator(keras_model=model, custom_objects={"relu6": nn.ReLU6})
    lossless = mf.Model(nn.Linear(4, 1))
    lossless.compile(optimizer="sgd")
    with pytest.raises(ValueError, match=r"compiled without a loss"):
        model_to_estimator(keras_model=lossless)


def test_a_saved_model_path_and_renamed_metrics(tmp_path):
    model = _compiled_model()
    model.save(str(tmp_path / "saved.keras"))
    estimator = model_to_estimator(keras_model_path=str(tmp_path / "saved.keras"), model_dir=str(tmp_path / "est"),
                                   config=_config(), metric_names_map={"mae": "mean_absolute_error"})
    estimator.train(_input_fn(8), steps=2)
    assert set(estimator.evaluate(_input_fn(8))) == {"loss", "mean_absolute_error", "global_step"}


def _train_and_evaluate(rank: int, world: int, model_dir: str) -> dict:
    strategy = mf.MultiWorkerMirroredStrategy()
    config = _config(train_distribute=strategy, save_checkpoints_steps=3)
    input_fn = _input_fn(8 // world)  # 8 examples per step in all
    results = {}
    for kind in ("converted", "by_hand"):
        directory = f"{model_dir}/{kind}"
        estimator = (model_to_estimator(keras_model=_compiled_model(), model_dir=directory, config=config)
                     if kind == "converted" else
                     mf.estimator.Estimator(_hand_written_model_fn(), model_dir=directory, config=config))
        results[kind], _ = mf.estimator.train_and_evaluate(
            estimator, mf.estimator.TrainSpec(input_fn, max_steps=6),
            mf.estimator.EvalSpec(_input_fn(8), steps=None, start_delay_secs=0, throttle_secs=0))
    return results


def test_train_and_evaluate_under_train_distribute_on_two_workers(tmp_path):
    ranks = run_distributed(_train_and_evaluate, world_size=2, args=(str(tmp_path),), timeout=300)
    converted, by_hand = ranks[0]["converted"], ranks[0]["by_hand"]
    assert converted["global_step"] == by_hand["global_step"] == 6
    for key in ("loss", "mae"):
        assert converted[key] == pytest.approx(by_hand[key], rel=1e-5), key
        assert ranks[1]["converted"][key] == pytest.approx(converted[key], rel=1e-6), key
