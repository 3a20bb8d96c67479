"""Layouts on real gloo processes: parameters become DTensors; fit on a (2, 2) mesh equals one process."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

from tests._interrupt import StopAfterBatch
from tests._multiproc import run_distributed
from tests.dtensor._model_axis_mlp import mlp, model_axis_layouts

STEPS, BATCH = 20, 8


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 8)).astype("float32")
    y = rng.integers(0, 4, size=(STEPS * BATCH,)).astype("int64")
    return x, y


def _full_weights(module):
    from torch.distributed.tensor import DTensor

    return [(t.full_tensor() if isinstance(t, DTensor) else t).detach().numpy().copy()
            for t in module.state_dict().values()]


def _fit(mf, layout_map=None):
    x, y = _data()
    scope = layout_map.scope() if layout_map is not None else mf.get_strategy().scope()
    with scope:
        model = mf.Model(mlp())
        model.compile(optimizer=mf.optimizers.Adam(0.01), loss=mf.losses.SparseCategoricalCrossentropy(
            from_logits=True), metrics=["accuracy"])
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    evaluation = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    predictions = model.predict(x[:5 * BATCH + 3], batch_size=BATCH, verbose=0)  # an uneven last batch
    return model, (history.history, evaluation, predictions)


def _fit_on_mesh(rank, world, shape, sharded):
    from torch.distributed.tensor import DTensor

    import meshfit as mf

    names = ("batch", "model")[:len(shape)] if len(shape) == 2 else ("batch",)
    mesh = mf.dtensor.create_mesh(list(zip(names, shape, strict=True)))
    layout_map = model_axis_layouts(mesh) if sharded else mf.dtensor.LayoutMap(mesh)
    model, (history, evaluation, predictions) = _fit(mf, layout_map)
    first = model.module[0].weight
    layout = first.layout
    kinds = (isinstance(first, DTensor), isinstance(first, nn.Parameter), tuple(first.to_local().shape)
             if isinstance(first, DTensor) else tuple(first.shape))
    return (_full_weights(model.module), (history, evaluation, predictions), layout.to_string(), kinds,
            model.strategy.input_context())


def _max_relative_difference(a, b):
    return max(float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-12)) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def reference():
    import meshfit as mf

    model, logs = _fit(mf)
    return _full_weights(model.module), logs


def test_fit_on_batch_by_model_mesh_equals_one_process(reference):
    results = run_distributed(_fit_on_mesh, world_size=4, args=((2, 2), True), timeout=300)
    ref_weights, (ref_history, ref_evaluation, ref_predictions) = reference
    for weights, (history, evaluation, predictions), layout, kinds, _ in results:
        assert _max_relative_difference(weights, ref_weights) <= 1e-5
        assert history["loss"][0] == pytest.approx(ref_history["loss"][0], rel=1e-5)
        assert history["accuracy"][0] == pytest.approx(ref_history["accuracy"][0])
        assert evaluation["loss"] == pytest.approx(ref_evaluation["loss"], rel=1e-5)
        assert evaluation["accuracy"] == pytest.approx(ref_evaluation["accuracy"])
        assert predictions.shape == ref_predictions.shape == (5 * BATCH + 3, 4)
        np.testing.assert_allclose(predictions, ref_predictions, rtol=1e-4, atol=1e-5)
        assert layout == "sharding_specs:model,unsharded, mesh:|batch=2,model=2|cpu"
        assert kinds == (True, True, (8, 8))  # a real DTensor parameter holding half the rows
    # peers along `model` read the same rows: the data-shard identity is the `batch` coordinate
    assert [c.input_pipeline_id for *_, c in results] == [0, 0, 1, 1]
    assert {c.num_input_pipelines for *_, c in results} == {2}


def _fit_multiworker(rank, world):
    import meshfit as mf

    strategy = mf.MultiWorkerMirroredStrategy()
    x, y = _data()
    with strategy.scope():
        model = mf.Model(mlp())
        model.compile(optimizer=mf.optimizers.Adam(0.01), loss=mf.losses.SparseCategoricalCrossentropy(
            from_logits=True), metrics=["accuracy"])
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return _full_weights(model.module)


def test_replicated_layouts_take_the_ddp_path_and_equal_one_process(reference):
    results = run_distributed(_fit_on_mesh, world_size=2, args=((2,), False), timeout=300)
    multiworker = run_distributed(_fit_multiworker, world_size=2, timeout=300)[0]
    ref_weights, _ = reference
    for weights, _, layout, kinds, _ in results:
        assert _max_relative_difference(weights, ref_weights) <= 1e-5
        assert layout == "sharding_specs:unsharded,unsharded, mesh:|batch=2|cpu"
        assert kinds == (False, True, (16, 8))  # plain parameters: DDP's bucketed all-reduce
        for a, b in zip(weights, multiworker, strict=True):  # a 1-D batch mesh is MultiWorkerMirroredStrategy
            # Equal up to fused Adam's rounding (a few ulp: its vectorised kernel's rounding depends on where
            # each element falls, and the mesh re-places the parameters); bitwise with the foreach update.
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


class Subclassed(nn.Module):
    def __init__(self):
        super().__init__()
        self.feature = nn.Linear(16, 16)
        self.dropout = nn.Dropout(0.1)
        self.feature_2 = nn.Linear(16, 24)

    def forward(self, x):
        return self.feature_2(self.dropout(self.feature(x)))


class Functional(nn.Module):
    """Keras's functional style: named layers wired in forward (``x = layers['feature'](inputs)``)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict(OrderedDict(feature=nn.Linear(16, 16), dropout=nn.Dropout(0.1),
                                                feature_2=nn.Linear(16, 32)))

    def forward(self, inputs):
        x = self.layers["feature"](inputs)
        x = self.layers["dropout"](x)
        return self.layers["feature_2"](x)


def _three_styles(rank, world):
    from torch.distributed.tensor import DTensor

    import meshfit as mf

    mesh = mf.dtensor.create_mesh([("batch", 2), ("model", 2)])
    layout_map = mf.dtensor.LayoutMap(mesh=mesh)
    layout_map["feature.*weight"] = mf.dtensor.Layout.batch_sharded(mesh, "batch", rank=2)
    layout_map["feature.*bias"] = mf.dtensor.Layout.batch_sharded(mesh, "batch", rank=1)
    sequential = nn.Sequential(OrderedDict(feature=nn.Linear(16, 16), dropout=nn.Dropout(0.1),
                                           feature_2=nn.Linear(16, 32)))
    found = {}
    for style, module in (("subclassed", Subclassed()), ("sequential", sequential), ("functional", Functional())):
        with layout_map.scope():
            model = mf.Model(module)
        model.compile(optimizer="adam", loss="mse")
        model.build(torch.zeros(4, 16))
        found[style] = {path: (type(p).__mro__[1].__name__ if not isinstance(p, DTensor) else "DTensor",
                               p.layout.to_string(), tuple(p.to_local().shape))
                        for path, p in model.module.named_parameters()}
        model.module.eval()
        out = model.module(torch.zeros(4, 16))  # plain inputs meet sharded weights
        found[style]["output"] = (type(out).__name__, tuple(out.shape))
    # the seed: call the model on a DTensor made with copy_to_mesh; DTensors in give DTensors out
    dtensor_input = mf.dtensor.copy_to_mesh(torch.zeros((16, 16)), layout=mf.dtensor.Layout.replicated(mesh, 2))
    out = model.module(dtensor_input)
    found["copy_to_mesh"] = (type(out).__name__, tuple(out.shape), tuple(mf.dtensor.unpack(out)[0].shape))
    return found


def test_three_model_styles_get_layouts_from_regex_keys():
    results = run_distributed(_three_styles, world_size=4, timeout=300)
    sharded = "sharding_specs:batch,unsharded, mesh:|batch=2,model=2|cpu"
    for found in results:
        sub = found["subclassed"]
        assert sub["feature.weight"] == ("DTensor", sharded, (8, 16))
        assert sub["feature_2.weight"] == ("DTensor", sharded, (12, 16))
        assert sub["feature.bias"][1:] == ("sharding_specs:batch, mesh:|batch=2,model=2|cpu", (8,))
        assert found["sequential"]["feature.weight"] == ("DTensor", sharded, (8, 16))
        assert found["sequential"]["feature_2.weight"] == ("DTensor", sharded, (16, 16))
        assert found["functional"]["layers.feature.weight"] == ("DTensor", sharded, (8, 16))
        assert found["functional"]["layers.feature_2.weight"] == ("DTensor", sharded, (16, 16))
        for style in ("subclassed", "sequential", "functional"):
            assert found[style]["output"][0] == "Tensor"  # this process's rows, a plain tensor
        assert found["subclassed"]["output"][1] == (4, 24)
        assert found["copy_to_mesh"][:2] == ("DTensor", (16, 32))


def _bad_world(rank, world):
    import meshfit as mf

    try:
        mf.dtensor.create_mesh([("batch", 2), ("model", 2)])
    except ValueError as error:
        return str(error)
    return None


def test_mesh_size_must_match_the_world_size():
    messages = run_distributed(_bad_world, world_size=2, timeout=120)
    assert all("it has 4 devices but 2 processes joined" in m and "--workers 4" in m for m in messages)


def _stop_on_one_process(rank, world):
    import meshfit as mf

    mesh = mf.dtensor.create_mesh([("model", 2)])  # no batch axis: one replica, two processes

    x, y = _data()
    with model_axis_layouts(mesh).scope():
        model = mf.Model(mlp())
        model.compile(optimizer="sgd", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[StopAfterBatch(1, asks=rank == 0)])
    return model.loop_state.iterations


def test_a_stop_raised_on_one_process_of_a_model_only_mesh_stops_both():
    # The flags of a step go through every process, not only the data-parallel replicas: here there
    # is one replica, and the process that did not ask must still stop at the same step.
    assert run_distributed(_stop_on_one_process, world_size=2, timeout=240) == [3, 3]
