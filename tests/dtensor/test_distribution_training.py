"""Keras 3's distribution API trains: a model created and fitted while a distribution is set (or inside
its scope) on 2 gloo processes ends equal to one process on the same global batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests._multiproc import run_distributed

EXAMPLES, GLOBAL_BATCH, EPOCHS = 64, 16, 2


def _data():
    rng = np.random.default_rng(3)
    return rng.normal(size=(EXAMPLES, 8)).astype("float32"), rng.integers(0, 4, size=EXAMPLES).astype("int64")


def _fit(how: str):
    import meshfit as mf

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = _data()
    distribution = None
    if how == "data_parallel":
        distribution = mf.distribution.DataParallel()  # every device of the job: one per process
    elif how == "model_parallel":
        mesh = mf.distribution.DeviceMesh((1, 2), ["batch", "model"], mf.distribution.list_devices())
        layout_map = mf.distribution.LayoutMap(mesh)
        layout_map[r"0\.weight"] = ("model", None)
        layout_map[r"0\.bias"] = ("model",)
        layout_map[r"2\.weight"] = (None, "model")
        distribution = mf.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    scope = None
    if how == "data_parallel_scope":  # created and fitted inside `with distribution.scope():`
        scope = mf.distribution.DataParallel(devices=mf.distribution.list_devices()).scope()
        scope.__enter__()
    elif distribution is not None:
        mf.distribution.set_distribution(distribution)
    try:
        model = mf.Model(module)
        model.compile(optimizer=mf.optimizers.Adam(0.01),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        kinds = sorted({type(p).__mro__[1].__name__ if hasattr(type(p), "_meshfit_layout_class") else
                        type(p).__name__ for p in model.module.parameters()})
        strategy = repr(model.strategy)
        return model.get_weights(), history.history["loss"], kinds, strategy
    finally:
        if scope is not None:
            scope.__exit__(None, None, None)
        mf.distribution.set_distribution(None)


def _all(rank, world):
    return {how: _fit(how) for how in ("data_parallel", "data_parallel_scope", "model_parallel")}


@pytest.fixture(scope="module")
def runs():
    return _fit("one_process"), run_distributed(_all, world_size=2, timeout=300)


def _close(got, want, tol=1e-5):
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("how", ["data_parallel", "data_parallel_scope", "model_parallel"])
def test_a_model_fitted_under_a_distribution_equals_one_process(runs, how):
    (weights, losses, *_), ranks = runs
    for result in ranks:
        got_weights, got_losses, kinds, strategy = result[how]
        assert "MeshStrategy" in strategy, strategy
        _close(got_weights, weights)
        assert got_losses == pytest.approx(losses, rel=1e-5)
        # DataParallel: plain replicated weights (DDP); ModelParallel: DTensors laid out by the map
        assert kinds == (["DTensor"] if how == "model_parallel" else ["Parameter"]), kinds
