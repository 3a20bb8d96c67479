"""Parameters that get no gradient in a step (an unused layer, a branch not taken) on 2 gloo workers.

One process leaves such a parameter unchanged (its gradient stays None, so SGD with momentum and Adam
skip it); plain DDP stops at the next step. Two workers must end with one process's weights on the
same global batch, and a model that uses every parameter must not keep DDP's per-step graph search.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _multiproc import run_distributed
from torch import nn

import meshfit as mf


class UnusedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(4, 3)
        self.unused = nn.Linear(4, 3)

    def forward(self, x):
        return self.dense(x)


class Branch(nn.Module):
    """``extra`` takes part on every other training step only (not on the first)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(4, 3)
        self.extra = nn.Linear(3, 3)
        self.calls = 0

    def forward(self, x):
        y = self.dense(x)
        if self.training:
            self.calls += 1
            if self.calls % 2 == 0:
                y = y + self.extra(y)
        return y


class AllUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(4, 3)

    def forward(self, x):
        return self.dense(x)


MODELS = {"unused_layer": UnusedLayer, "branch": Branch, "all_used": AllUsed}


def _optimizer(name: str):
    return mf.optimizers.Adam(0.05) if name == "adam" else mf.optimizers.SGD(0.1, momentum=0.9)


def _train(strategy, model_name: str, optimizer: str):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(37, 4)).astype("float32"), rng.normal(size=(37, 3)).astype("float32")
    with strategy.scope():
        model = mf.Model(MODELS[model_name]())
        model.compile(_optimizer(optimizer), "mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)  # 37 = 4 * 8 + 5: a last batch split 3 + 2
    searching = getattr(model.placement.module, "find_unused_parameters", None)  # None: no DDP (one process)
    return model.get_weights(), searching


def _worker(rank: int, world: int, model_name: str, optimizer: str, compression: str | None = None):
    options = mf.CommunicationOptions(gradient_compression=compression)
    return _train(mf.MultiWorkerMirroredStrategy(communication_options=options), model_name, optimizer)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("model_name", ["unused_layer", "branch"])
def test_two_workers_equal_one_process_with_parameters_without_gradient(model_name, optimizer):
    single, _ = _train(mf.OneDeviceStrategy("cpu"), model_name, optimizer)
    results = run_distributed(_worker, world_size=2, args=(model_name, optimizer), timeout=180)
    for weights, searching in results:
        assert searching is True  # the graph search stays on for a model that has such parameters
        for got, want in zip(weights, single, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if model_name == "unused_layer":
        start = [p.detach().numpy() for p in (torch.manual_seed(0), UnusedLayer())[1].state_dict().values()]
        for weights, _ in results:  # the unused layer is unchanged, momentum and Adam's moments included
            np.testing.assert_array_equal(weights[2], start[2])
            np.testing.assert_array_equal(weights[3], start[3])


def test_a_model_using_every_parameter_drops_the_graph_search():
    single, _ = _train(mf.OneDeviceStrategy("cpu"), "all_used", "adam")
    results = run_distributed(_worker, world_size=2, args=("all_used", "adam"), timeout=180)
    for weights, searching in results:
        assert searching is False
        for got, want in zip(weights, single, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bfloat16_compression_with_an_unused_layer():
    single, _ = _train(mf.OneDeviceStrategy("cpu"), "unused_layer", "adam")
    results = run_distributed(_worker, world_size=2, args=("unused_layer", "adam", "bfloat16"), timeout=180)
    for weights, searching in results:
        assert searching is True
        for got, want in zip(weights[:2], single[:2], strict=True):  # the used layer: bfloat16 rounding
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-2)
        np.testing.assert_array_equal(weights[2], single[2])  # the unused layer: untouched
        np.testing.assert_array_equal(weights[3], single[3])


def _first_wrapper_freed(rank: int, world: int, compression: str | None):
    import gc
    import weakref

    options = mf.CommunicationOptions(gradient_compression=compression)
    with mf.MultiWorkerMirroredStrategy(communication_options=options).scope():
        model = mf.Model(AllUsed())
        model.compile("sgd", "mse")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 3), "float32")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # one step under the first (probing) wrapper
    probing = model.placement.module
    first = [weakref.ref(probing.wrapped), weakref.ref(probing.wrapped.reducer)]
    started: list[int] = []

    def record(phase, info):
        if phase == "start":
            started.append(info["generation"])

    gc.disable()  # no collection by allocation counts: only an explicit one would start
    gc.callbacks.append(record)
    try:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # the next training forward re-wraps the module
    finally:
        gc.callbacks.remove(record)
        gc.enable()
    return [ref() is None for ref in first], started, probing.find_unused_parameters


@pytest.mark.parametrize("compression", [None, "bfloat16"])
def test_the_first_steps_wrapper_and_its_hooks_are_freed_without_collecting_the_heap(compression):
    # A collection of the whole heap costs 0.2-0.3 s of CPU in a process that imported torch.
    for freed, started, searching in run_distributed(_first_wrapper_freed, world_size=2, args=(compression,),
                                                     timeout=120):
        assert freed == [True, True]  # the first wrapper and its reducer (whose autograd hooks go with it)
        assert started == [], started  # no collection was needed to free them
        assert searching is False
