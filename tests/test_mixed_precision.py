"""mf.mixed_precision: Keras's policy names; bf16 autocast in the steps with float32 master weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf
from meshfit import mixed_precision


@pytest.fixture(autouse=True)
def _reset_policy():
    yield
    mixed_precision.set_global_policy(None)


def test_policies_and_their_dtypes():
    assert mixed_precision.global_policy() == mixed_precision.Policy("float32")
    for name, compute in [("float32", "float32"), ("mixed_bfloat16", "bfloat16"), ("mixed_float16", "float16")]:
        policy = mixed_precision.Policy(name)
        assert (policy.name, policy.compute_dtype, policy.variable_dtype) == (name, compute, "float32")
    mixed_precision.set_global_policy("mixed_bfloat16")
    assert repr(mixed_precision.global_policy()) == '<Policy "mixed_bfloat16">'
    mixed_precision.set_global_policy(mixed_precision.Policy("float32"))
    assert mixed_precision.global_policy().name == "float32"


def test_bad_policies_are_named():
    with pytest.raises(ValueError, match=r"received name='mixed_bf16'"):
        mixed_precision.set_global_policy("mixed_bf16")
    with pytest.raises(TypeError, match=r"received policy=16"):
        mixed_precision.set_global_policy(16)



def test_mixed_float16_autocasts_on_the_cpu_too():
    # Keras runs mixed_float16 on any device (fp16 is slow on CPUs, but correct); so does torch's
    # CPU autocast. Before issue 23 this was refused ("runs on CUDA only").
    mixed_precision.set_global_policy("mixed_float16")
    with mixed_precision.autocast("cpu"):
        assert nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.float16


def _data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x[:, :4].sum(axis=1) > x[:, 4:].sum(axis=1)).astype("int64")
    return x, y


def _model():
    torch.manual_seed(0)
    model = mf.Model(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2)))
    model.compile(optimizer=mf.optimizers.SGD(learning_rate=0.1),
                  loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def test_bf16_forward_fp32_master_weights_and_fit_trains():
    mixed_precision.set_global_policy("mixed_bfloat16")
    model = _model()
    seen = []
    model.module.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    grads = []
    for p in model.module.parameters():
        p.register_hook(lambda g: grads.append(g.dtype))
    x, y = _data()
    history = model.fit(x, y, batch_size=32, epochs=4, verbose=0)
    assert set(seen) == {torch.bfloat16}                      # the steps' forward ran in bf16
    assert {p.dtype for p in model.module.parameters()} == {torch.float32}  # master weights
    assert set(grads) == {torch.float32}                      # gradients reach them in fp32
    losses = history.history["loss"]
    assert losses[-1] < 0.7 * losses[0], losses               # it trains
    predictions = model.predict(x[:4], verbose=0)             # numpy has no bf16: float32 out
    assert predictions.dtype == np.float32 and predictions.shape == (4, 2)
    assert set(seen) == {torch.bfloat16}
    seen.clear()
    model.evaluate(x, y, batch_size=64, verbose=0)
    assert set(seen) == {torch.bfloat16}


def test_float32_policy_changes_nothing():
    model = _model()
    seen = []
    model.module.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    x, y = _data(64)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert set(seen) == {torch.float32}


def test_bf16_is_close_to_fp32():
    x, y = _data()
    fp32 = _model()
    fp32.fit(x, y, batch_size=32, epochs=2, verbose=0)
    mixed_precision.set_global_policy("mixed_bfloat16")
    bf16 = _model()
    bf16.fit(x, y, batch_size=32, epochs=2, verbose=0)
    for a, b in zip(fp32.module.parameters(), bf16.module.parameters(), strict=True):
        assert not torch.equal(a, b)                   # it did compute in another precision
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.05)
