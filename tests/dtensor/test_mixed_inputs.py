"""Plain inputs meet sharded weights, and packed inputs meet replicated ones, whichever spelling gave
the layouts (per layer, a LayoutMap scope, an empty LayoutMap scope), for a plain module and for
``mf.Model``: a custom loop on 2 processes equals one process on the same global batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests._multiproc import run_distributed

STEPS, GLOBAL = 4, 8
SPELLINGS = ["per_layer", "layout_map", "empty_map", "lazy_map"]
WRAPPERS = ["plain", "model"]
INPUTS = ["plain", "packed"]


def _data():
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.normal(size=(STEPS * GLOBAL, 6)).astype("float32"))
    y = torch.from_numpy(rng.integers(0, 4, size=STEPS * GLOBAL).astype("int64"))
    return [(x[i:i + GLOBAL], y[i:i + GLOBAL]) for i in range(0, len(x), GLOBAL)]


class Net(nn.Module):
    def __init__(self, lazy=False):
        super().__init__()
        self.feature = nn.LazyLinear(8) if lazy else nn.Linear(6, 8)
        self.head = nn.LazyLinear(4) if lazy else nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.feature(x)))


def _loop(mesh, spelling, wrapper, inputs):
    import meshfit as mf

    torch.manual_seed(0)
    if mesh is None:
        module = Net(lazy=spelling == "lazy_map")
    elif spelling == "per_layer":  # Dense(kernel_layout=...): each layer given its layouts
        module = Net()
        mf.dtensor.apply_layouts(module.feature, {"weight": mf.dtensor.Layout(["batch", mf.dtensor.UNSHARDED], mesh),
                                                  "bias": mf.dtensor.Layout(["batch"], mesh)})
        mf.dtensor.apply_layouts(module.head, {"weight": mf.dtensor.Layout.replicated(mesh, 2)})
    else:
        layout_map = mf.dtensor.LayoutMap(mesh)
        if spelling in ("layout_map", "lazy_map"):
            layout_map[r"feature\.weight"] = mf.dtensor.Layout(["batch", mf.dtensor.UNSHARDED], mesh)
        with layout_map.scope():  # a lazy module gets its layouts at its first call
            module = Net(lazy=spelling == "lazy_map")
    model = mf.Model(module) if wrapper == "model" else module
    if spelling == "lazy_map":  # the shapes are known once it has seen a batch
        x, _ = _data()[0]
        if mesh is not None:
            x = mf.dtensor.pack(list(x.tensor_split(2)), mf.dtensor.Layout.batch_sharded(mesh, "batch", 2))
        model(x)
    params = list(module.parameters())
    optimizer = mf.optimizers.SGD(0.1, mesh=mesh)
    loss_fn = mf.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    rank = mesh.device_mesh.get_rank() if mesh is not None else 0
    losses = []
    for x, y in _data():
        if mesh is not None and inputs == "packed":
            x = mf.dtensor.pack(list(x.tensor_split(2)), mf.dtensor.Layout.batch_sharded(mesh, "batch", 2))
            y = mf.dtensor.pack(list(y.tensor_split(2)), mf.dtensor.Layout.batch_sharded(mesh, "batch", 1))
        elif mesh is not None:  # this process's rows, as a distributed dataset gives them
            x, y = x.tensor_split(2)[rank], y.tensor_split(2)[rank]
        logits = model(x)
        loss = loss_fn(y, logits) / GLOBAL  # TF's compute_average_loss: the global batch
        gradients = torch.autograd.grad(loss, params)
        optimizer.apply_gradients(zip(gradients, params, strict=True))
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    weights = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().numpy().copy() for p in params]
    built = model.placement is not None if wrapper == "model" else None  # mf.Model: its first call built it
    return weights, losses, type(logits).__name__, type(module.feature.weight).__mro__[1].__name__, built


def _reference(spelling):
    return _loop(None, spelling, "plain", "plain")


def _all(rank, world):
    import meshfit as mf

    mesh = mf.dtensor.create_mesh([("batch", 2)])
    outcomes = {}
    for spelling in SPELLINGS:
        for wrapper in WRAPPERS:
            for inputs in INPUTS:
                try:
                    outcomes[spelling, wrapper, inputs] = _loop(mesh, spelling, wrapper, inputs)
                except Exception as error:  # noqa: BLE001 (reported by the test of that combination)
                    outcomes[spelling, wrapper, inputs] = f"{type(error).__name__}: {error}"
    return outcomes


@pytest.fixture(scope="module")
def runs():
    return {"eager": _reference(""), "lazy": _reference("lazy_map")}, run_distributed(_all, world_size=2, timeout=500)


@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_inputs_meet_the_weights_without_conversion(runs, spelling, wrapper, inputs):
    references, ranks = runs
    weights, losses, *_ = references["lazy" if spelling == "lazy_map" else "eager"]
    for outcome in ranks:
        result = outcome[spelling, wrapper, inputs]
        assert not isinstance(result, str), result  # no "mixed torch.Tensor and DTensor" error
        got_weights, got_losses, output_kind, weight_kind, built = result
        assert built in ((True,) if wrapper == "model" else (None,))
        # the output comes back as the caller passed the input: local rows, or a DTensor
        assert output_kind == ("DTensor" if inputs == "packed" else "Tensor"), output_kind
        assert weight_kind == ("Parameter" if spelling == "empty_map" else "DTensor"), weight_kind
        for a, b in zip(got_weights, weights, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        if inputs == "packed":  # the loss of the global batch; with plain inputs each process has its rows'
            assert got_losses == pytest.approx(losses, rel=1e-5)
