"""Model.summary(), count_params, weights lists, layers and model(x, training=...) as in Keras."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf


def seed_cnn() -> nn.Module:
    """The seed's Conv2D(32, 3) + Dense(128) + Dense(10) on 28x28 images, ported as SPEC shows."""
    return nn.Sequential(nn.Unflatten(1, (1, 28)), nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Flatten(),
                         nn.LazyLinear(128), nn.ReLU(), nn.Linear(128, 10))


def _lines(model: mf.Model, **kwargs) -> list[str]:
    out: list[str] = []
    model.summary(print_fn=out.append, **kwargs)
    return out


def test_seed_cnn_summary_prints_keras_parameter_count():
    # Keras's summary of the seed's model, by hand: Conv2D(32, 3) on one channel has 3*3*1*32 + 32
    # weights; Flatten gives 26*26*32 = 21632 features; Dense(128) has 21632*128 + 128; Dense(10) 128*10 + 10.
    conv = 3 * 3 * 1 * 32 + 32
    dense_128 = 26 * 26 * 32 * 128 + 128
    dense_10 = 128 * 10 + 10
    keras_total = conv + dense_128 + dense_10
    assert keras_total == 2_770_634
    torch.manual_seed(0)
    model = mf.Model(seed_cnn(), name="sequential")
    with pytest.raises(ValueError, match="not yet been built"):
        model.summary()
    with pytest.raises(ValueError, match="not yet been built"):
        model.count_params()
    x = np.zeros((4, 28, 28), "float32")
    model.predict(x, verbose=0)  # builds the lazy layer, as Keras builds on first call
    lines = _lines(model)
    assert lines[0] == 'Model: "sequential"'
    assert lines[2].split() == ["Layer", "(type)", "Output", "Shape", "Param", "#"]
    rows = {line.split()[1]: line.split() for line in lines if line.startswith(" ") and "(" in line}
    assert rows["(Conv2d)"][-5:] == ["(None,", "32,", "26,", "26)", f"{conv:,}"]
    assert rows["(Flatten)"][-3:] == ["(None,", "21632)", "0"]
    assert rows["(Linear)"][-3:] == ["(None,", "10)", f"{dense_10:,}"]
    assert any(line.endswith(f" {dense_128:,}") and "(None, 128)" in line for line in lines)
    assert f"Total params: {keras_total:,}" in lines
    assert f"Trainable params: {keras_total:,}" in lines
    assert "Non-trainable params: 0" in lines
    assert model.count_params() == keras_total


def test_summary_prints_to_stdout_and_leaves_rng_and_modes_alone(capsys):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 5), nn.Dropout(0.5), nn.BatchNorm1d(5), nn.Linear(5, 2))
    module[2].eval()  # a frozen batch norm: its mode must survive the summary's forward pass
    model = mf.Model(module)
    model.build(torch.ones(3, 6))
    before_rng = torch.get_rng_state()
    running_mean = module[2].running_mean.clone()
    assert model.summary() is None
    text = capsys.readouterr().out
    assert "(None, 5)" in text and "(None, 2)" in text
    assert torch.equal(torch.get_rng_state(), before_rng)
    assert torch.equal(module[2].running_mean, running_mean)
    assert module.training and module[1].training and not module[2].training


def test_weights_lists_follow_keras_trainable_and_non_trainable():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    module[2].weight.requires_grad_(False)
    model = mf.Model(module)
    trainable = model.trainable_weights
    assert [tuple(t.shape) for t in trainable] == [(3, 4), (3,), (3,), (3,), (2,)]
    assert all(isinstance(t, nn.Parameter) for t in trainable)
    assert model.trainable_variables == trainable
    non_trainable = model.non_trainable_weights
    # The frozen weight, then BN's running mean and variance (its int counter is no Keras weight).
    assert non_trainable[0] is module[2].weight
    assert non_trainable[1] is module[1].running_mean and non_trainable[2] is module[1].running_var
    assert len(non_trainable) == 3
    assert len(model.weights) == 8 and model.weights[:5] == trainable
    assert model.count_params() == (12 + 3) + (3 + 3) + 2 + 6 + 6
    lines = _lines(model, show_trainable=True)
    assert "Total params: 35" in lines and "Trainable params: 23" in lines and "Non-trainable params: 12" in lines
    flags = {line.split()[1]: line.split()[-1] for line in lines if "(Linear)" in line or "(BatchNorm1d)" in line}
    assert flags == {"(Linear)": "Partial", "(BatchNorm1d)": "Y"}
    assert model.layers == list(module)


def test_nested_modules_one_row_per_child_or_expanded():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            return self.head(self.features(x))

    model = mf.Model(Net())
    model.build(torch.zeros(2, 4))
    rows = [line.split() for line in _lines(model) if line.startswith(" ") and "(" in line][1:]
    assert [r[:2] for r in rows] == [["features", "(Sequential)"], ["head", "(Linear)"]]
    assert rows[0][-1] == "40" and rows[1][-1] == "9"
    expanded = [line for line in _lines(model, expand_nested=True) if "(" in line][1:]
    assert [line.split()[0] for line in expanded] == ["features", "features.0", "features.1", "head"]
    assert expanded[1].startswith("   features.0")  # indented under its parent
    assert model.layers == [model.module.features, model.module.head]
    single = mf.Model(nn.Linear(3, 2))
    assert single.layers == [single.module]
    assert any("linear (Linear)" in line and line.split()[-1] == "8" for line in _lines(single))


def test_call_with_training_flag_sets_the_mode_for_that_call_only():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.9))
    model = mf.Model(module)
    x = torch.ones(4, 8)
    module.train()
    inference = model(x, training=False)
    assert torch.equal(inference, module[0](x))  # no dropout
    assert module.training
    module.eval()
    dropped = model(x, training=True)
    assert (dropped == 0).any()  # dropout on
    assert not module.training and not module[1].training


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.dense = nn.Linear(3, 4)

    def forward(self, tokens, features, scale=None):
        out = self.embed(tokens).sum(1) + self.dense(features)
        return out if scale is None else out * scale


def test_call_converts_numpy_inputs_as_keras_does():
    # Keras converts a layer's numpy inputs to tensors; float ones take the layer's dtype (float32 here,
    # although numpy's default is float64), integer ones keep theirs.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 4), nn.Dropout(0.9))
    model = mf.Model(module)
    x = np.random.default_rng(0).normal(size=(5, 8))  # float64
    expected = module[0](torch.as_tensor(x, dtype=torch.float32))
    out = model(x)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    module.eval()
    assert torch.equal(model(x), expected)
    assert torch.equal(model(x, training=False), expected)
    assert (model(x, training=True) == 0).any()  # converted, then run in train mode
    two = mf.Model(_TwoInputs())
    tokens, features = np.array([[1, 2], [3, 4]]), np.ones((2, 3), "f8")
    reference = two.module(torch.as_tensor(tokens), torch.ones(2, 3))
    assert torch.equal(two(tokens, features), reference)  # int64 tokens stay integers for the embedding
    assert torch.equal(two(tokens, features=features, scale=np.float64(2.0) * np.ones(1)), reference * 2)
    double = mf.Model(nn.Linear(8, 1).double())
    assert double(x.astype("f4")).dtype == torch.float64  # the module's dtype, as Keras's input_dtype
