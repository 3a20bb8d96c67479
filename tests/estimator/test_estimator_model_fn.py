"""``model_fn`` and ``input_fn`` are called as TF calls them; fresh modules are refused, not trained."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf
from meshfit.estimator import Estimator, EstimatorSpec, FreshModuleError, ModeKeys, RunConfig, once

X = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
Y = (X.sum(1) > 0).astype(np.int64)


def input_fn(mode):
    return mf.data.Dataset.from_tensor_slices((X, Y)).batch(8)


def _spec(model, features, labels, mode, optimizer=None):
    logits = model(features)
    if mode == ModeKeys.PREDICT:
        return EstimatorSpec(mode, predictions={"logits": logits})
    loss = nn.functional.cross_entropy(logits, labels)
    if mode == ModeKeys.EVAL:
        return EstimatorSpec(mode, loss=loss)
    optimizer = optimizer or once(lambda: torch.optim.SGD(model.parameters(), lr=0.1))
    return EstimatorSpec(mode, loss=loss, train_op=mf.estimator.minimize(optimizer, loss))


def _config():
    return RunConfig(save_checkpoints_steps=2, log_step_count_steps=None)


def test_model_fn_signature_is_checked_as_tf_does(tmp_path):
    with pytest.raises(ValueError, match="must take a `features` argument"):
        Estimator(lambda x, labels, mode: None, model_dir=tmp_path)
    with pytest.raises(ValueError, match=r"arguments \['hparams'\] that an Estimator cannot fill"):
        Estimator(lambda features, labels, mode, hparams: None, model_dir=tmp_path)
    with pytest.raises(ValueError, match="takes no `params` argument, but params="):
        Estimator(lambda features, labels, mode: None, model_dir=tmp_path, params={"lr": 1})
    with pytest.raises(TypeError, match="Invalid `model_fn`"):
        Estimator("model_fn", model_dir=tmp_path)
    with pytest.raises(ValueError, match="Invalid `model_dir`"):
        Estimator(lambda features: None, model_dir=tmp_path / "a", config=RunConfig(model_dir=str(tmp_path / "b")))


def test_model_fn_and_input_fn_get_the_arguments_they_name(tmp_path):
    seen = {}
    module = nn.Linear(4, 2)

    def model_fn(features, mode, params, config, labels):
        seen["model_fn"] = (mode, params, config)
        return _spec(params["module"], features, labels, mode)

    def my_input_fn(params, mode, config):
        seen["input_fn"] = (mode, params, config)
        return input_fn(mode)

    estimator = Estimator(model_fn, model_dir=tmp_path, config=_config(), params={"module": module})
    estimator.train(my_input_fn, steps=1)
    assert seen["model_fn"][0] == ModeKeys.TRAIN and seen["model_fn"][1]["module"] is module
    assert seen["model_fn"][2] is estimator.config and seen["input_fn"][2] is estimator.config
    assert seen["input_fn"][:2] == (ModeKeys.TRAIN, estimator.params)


def test_model_fn_without_labels_argument_gets_a_clear_error(tmp_path):
    def model_fn(features, mode):
        raise AssertionError("not reached")

    with pytest.raises(ValueError, match="takes no `labels` argument, but input_fn yields"):
        Estimator(model_fn, model_dir=tmp_path).train(input_fn, steps=1)


def test_a_model_fn_building_a_fresh_module_each_call_is_refused(tmp_path):
    def model_fn(features, labels, mode):  # the seed's shape without once(): a new module per call
        model = nn.Linear(4, 2)
        return _spec(model, features, labels, mode, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    estimator = Estimator(model_fn, model_dir=tmp_path, config=_config())
    with pytest.raises(FreshModuleError, match=r"built a new Linear .*call 2.*mf\.estimator\.once"):
        estimator.train(input_fn, steps=3)
    assert estimator.latest_checkpoint() is None  # nothing was trained, nothing saved


def test_a_model_fn_building_a_fresh_optimizer_each_call_is_refused(tmp_path):
    def model_fn(features, labels, mode):
        model = once(lambda: nn.Linear(4, 2))
        return _spec(model, features, labels, mode, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    with pytest.raises(FreshModuleError, match="created a new optimizer"):
        Estimator(model_fn, model_dir=tmp_path, config=_config()).train(input_fn, steps=3)


def test_once_keeps_one_object_per_call_site_and_estimator(tmp_path):
    built = []

    def model_fn(features, labels, mode):
        model = once(lambda: built.append(1) or nn.Linear(4, 2))
        heads = [once(lambda: nn.Identity()) for _ in range(2)]  # a loop: one object per iteration
        assert heads[0] is not heads[1]
        return _spec(model, features, labels, mode)

    Estimator(model_fn, model_dir=tmp_path / "a", config=_config()).train(input_fn, steps=3)
    assert len(built) == 1
    Estimator(model_fn, model_dir=tmp_path / "b", config=_config()).train(input_fn, steps=1)
    assert len(built) == 2  # a new Estimator builds its own
    with pytest.raises(RuntimeError, match="inside a model_fn"):
        once(lambda: nn.Linear(1, 1))


def test_a_module_passed_in_params_trains(tmp_path):
    module = nn.Linear(4, 2)
    before = module.weight.detach().clone()

    def model_fn(features, labels, mode, params):
        return _spec(params["module"], features, labels, mode)

    Estimator(model_fn, model_dir=tmp_path, config=_config(), params={"module": module}).train(input_fn, steps=2)
    assert not torch.equal(before, module.weight)


def test_unsupported_input_fn_results_are_errors(tmp_path):
    def model_fn(features, labels, mode):
        return _spec(once(lambda: nn.Linear(4, 2)), features, labels, mode)

    estimator = Estimator(model_fn, model_dir=tmp_path, config=_config())
    with pytest.raises(TypeError, match="return a meshfit.data.Dataset"):
        estimator.train(lambda: (torch.zeros(2, 4), torch.zeros(2)), steps=1)
    with pytest.raises(TypeError, match="Invalid `x`"):
        estimator.train(lambda: 42, steps=1)


def test_a_layout_map_is_refused_rather_than_ignored(tmp_path):
    class HandMap:  # what layout_map.scope() sets on a mesh strategy: per-weight layouts, not fully_sharded
        is_fully_sharded = False

    class LaidOut(mf.OneDeviceStrategy):
        layout_map = HandMap()

    def model_fn(features, labels, mode):
        return _spec(once(lambda: nn.Linear(4, 2)), features, labels, mode)

    estimator = Estimator(model_fn, model_dir=tmp_path, config=RunConfig(train_distribute=LaidOut("cpu")))
    with pytest.raises(ValueError, match="LayoutMap.*not supported by the Estimator yet"):
        estimator.train(input_fn, steps=1)
