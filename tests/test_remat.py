"""Activation checkpointing (Keras 3's ``RematScope`` / ``remat``): memory for compute, values unchanged.

Weights after training with each mode are bitwise equal to training without remat (one process, a
dropout model whose recomputed masks must match, and the 2-D tests' transformer), and under
``LayoutMap.fully_sharded`` on 2 gloo processes; "full" on a deep MLP holds at most 0.6 of the memory
without remat at the end of a step's forward pass; bad arguments are refused by name.
"""

from __future__ import annotations

import resource

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf
from tests._multiproc import run_distributed
from tests.dtensor import _two_d_model as lm


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 32), nn.Tanh(),
                         nn.Sequential(nn.Linear(32, 32), nn.SiLU()), nn.Linear(32, 4))


def _train(make, scope=None, steps=6):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16 * steps, 8)).astype("float32"), rng.integers(0, 4, 16 * steps).astype("int64")
    torch.manual_seed(1)  # the dropout masks
    with scope if scope is not None else mf.get_strategy().scope():
        model = mf.Model(make())
    model.compile(optimizer=mf.optimizers.Adam(0.01), loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("scope, expected", [
    (lambda: mf.RematScope(mode="full"), ["0", "3", "5.0", "6"]),
    (lambda: mf.RematScope(mode="activations"), ["1", "4", "5.1"]),
    (lambda: mf.RematScope(mode="larger_than", output_size_threshold=16 * 32), ["0", "3", "5.0", "6"]),
    (lambda: mf.RematScope(mode=None, layer_names=["3", "SiLU"]), ["3", "5.1"]),
])
def test_each_mode_changes_memory_never_values(scope, expected):
    plain = _train(_mlp)
    remat = _train(_mlp, scope())
    assert sorted(mf.nn.rematerialized(remat.module)) == sorted(expected)
    for got, want in zip(remat.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_transformer_in_a_scope_and_a_block_by_hand_train_bitwise_equal():
    x, y = lm.data(lm.BATCH * 4)

    def fit(prepare):
        with mf.get_strategy().scope():
            model = mf.Model(prepare(lm.module()))
        model.compile(optimizer=mf.optimizers.AdamW(1e-3), loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=lm.BATCH, epochs=1, shuffle=False, verbose=0)
        return model

    plain = fit(lambda m: m)
    with mf.RematScope(mode="full"):
        scoped = fit(lambda m: m)
    by_hand = fit(lambda m: (mf.remat(m.layers[0]), m)[1])
    assert sorted(mf.nn.rematerialized(scoped.module)) == ["embed", "head", "layers.0", "layers.1", "norm"]
    assert list(mf.nn.rematerialized(by_hand.module)) == ["layers.0"]
    for model in (scoped, by_hand):
        for got, want in zip(model.get_weights(), plain.get_weights(), strict=True):
            np.testing.assert_array_equal(got, want)
    assert list(scoped.module.state_dict()) == list(plain.module.state_dict())  # paths unchanged


def _fully_sharded(rank, world, remat):
    import meshfit as mf
    from tests.dtensor import _two_d_model as lm

    x, y = lm.data(lm.BATCH * 4)
    mesh = mf.dtensor.create_mesh([("batch", world)])
    with mf.dtensor.LayoutMap.fully_sharded(mesh).scope():
        if remat:
            with mf.RematScope(mode="full"):
                model = mf.Model(lm.module())
        else:
            model = mf.Model(lm.module())
        model.compile(optimizer=mf.optimizers.AdamW(1e-3), loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=lm.BATCH, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


def test_remat_composes_with_fully_sharded_bitwise():
    plain = run_distributed(_fully_sharded, world_size=2, args=(False,), timeout=300)[0]
    remat = run_distributed(_fully_sharded, world_size=2, args=(True,), timeout=300)[0]
    for got, want in zip(remat, plain, strict=True):
        np.testing.assert_array_equal(got, want)


def _forward_memory(rank, world, mode):
    """The memory a training step holds at the end of its forward pass: what the backward pass will read
    (the activations kept for it), as this process's resident memory grows over the forward of a
    second step (the first loads what checkpointing imports). Large allocations are mapped and unmapped
    one by one (glibc's mmap threshold at 64 KiB), so resident memory counts live tensors alone."""
    import ctypes

    import torch
    from torch import nn

    import meshfit as mf

    ctypes.CDLL(None).mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    torch.manual_seed(0)
    width, depth, batch = 1024, 12, 2048
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())]
    with mf.RematScope(mode=mode):
        model = mf.Model(nn.Sequential(*layers))
    x = torch.randn(batch, width)

    def resident() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()

    model.module(x).square().mean().backward()
    before = resident()
    out = model.module(x)
    held = resident() - before
    out.square().mean().backward()
    return held


def test_full_remat_of_a_deep_mlp_halves_the_memory_a_step_holds_for_its_backward():
    """12 x (Linear 1024, GELU), batch 2048: each activation 8 MiB. Without remat the forward keeps two
    per layer (the Linear's input, GELU's input: 192 MiB); with "full" one, each segment's input."""
    plain = run_distributed(_forward_memory, world_size=1, args=(None,), timeout=300)[0]
    full = run_distributed(_forward_memory, world_size=1, args=("full",), timeout=300)[0]
    assert plain > 180 * 2**20, plain
    assert full <= 0.6 * plain, (full / plain, full, plain)


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match=r"Invalid `mode`.*'full', 'activations', 'larger_than' or None.*mode='all'"):
        mf.RematScope(mode="all")
    with pytest.raises(ValueError, match=r"Invalid `output_size_threshold`.*output_size_threshold=0"):
        mf.RematScope(mode="larger_than", output_size_threshold=0)
    with pytest.raises(ValueError, match=r"Invalid `layer_names`.*layer_names='blocks.0'"):
        mf.RematScope(layer_names="blocks.0")
    with pytest.raises(TypeError, match=r"Invalid `module`.*received function"):
        mf.remat(lambda x: x)


def _two_d(rank, world, remat):
    import meshfit as mf
    from tests.dtensor import _two_d_model as lm

    x, y = lm.data(lm.BATCH * 4)
    with lm.scope(mf, (2, 2)):
        if remat:
            with mf.RematScope(mode="full"):
                model = mf.Model(lm.module())
        else:
            model = mf.Model(lm.module())
        model.compile(optimizer=lm.optimizer(mf, "sgd"), loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=lm.BATCH, epochs=1, shuffle=False, verbose=0)
    return model.get_weights(), sorted(mf.nn.rematerialized(model.module))


def test_remat_composes_with_tensor_parallel_on_a_2d_mesh_bitwise():
    """``(batch 2, model 2)`` with the guide's map (tensor parallel inside each block, fully sharded over
    ``batch``): remat's blocks recompute through the tensor-parallel collectives, values unchanged."""
    plain, _ = run_distributed(_two_d, world_size=4, args=(False,), timeout=400)[0]
    remat, paths = run_distributed(_two_d, world_size=4, args=(True,), timeout=400)[0]
    assert paths == ["embed", "head", "layers.0", "layers.1", "norm"]
    for got, want in zip(remat, plain, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_deep_copy_of_a_rematerialized_model_runs_its_own_weights():
    """``copy.deepcopy`` (the Estimator's ``model_to_estimator``, a user's teacher or EMA copy) gives a
    module that computes with the copy's parameters, rematerialized as the original."""
    import copy

    for scope in (mf.RematScope(mode="full"), mf.RematScope(mode=None, layer_names=["0"])):
        with scope:
            model = mf.Model(_mlp())
        twin = copy.deepcopy(model.module)
        with torch.no_grad():
            for parameter in twin.parameters():
                parameter.zero_()
        x = torch.randn(4, 8)
        twin.eval()
        assert torch.count_nonzero(twin(x)) == 0  # zero weights, zero output: the copy's own
        assert list(mf.nn.rematerialized(twin)) == list(mf.nn.rematerialized(model.module))
        assert not torch.equal(model.module.eval()(x), twin(x))
        twin.train()
        twin(torch.randn(4, 8, requires_grad=True)).sum().backward()
        assert all(p.grad is not None for p in twin.parameters())  # the copy's parameters get the gradients
        assert all(p.grad is None for p in model.module.parameters())
