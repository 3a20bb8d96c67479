"""Tests for meshfit._saving._architecture: JSON configs of standard torch.nn layer stacks."""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest
import torch
from torch import nn

from meshfit._saving._architecture import module_from_config, module_to_config, supported_layers


def _seed_cnn():
    return nn.Sequential(
        nn.Unflatten(1, (1, 28, 28)), nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(128), nn.ReLU(),
        nn.Linear(128, 10),
    )  # fmt: skip


def _signature(module):
    return {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}


def _rebuild(module):
    config = module_to_config(module)
    assert config is not None
    return module_from_config(json.loads(json.dumps(config, allow_nan=False)))


def test_seed_cnn_round_trips_with_identical_outputs():
    torch.manual_seed(0)
    model = _seed_cnn()
    x = torch.rand(3, 784)
    model(x)  # materialises the LazyLinear
    rebuilt = _rebuild(model)
    assert _signature(rebuilt) == _signature(model)
    assert isinstance(rebuilt[4], nn.Linear) and rebuilt[4].in_features == 32 * 26 * 26
    rebuilt.load_state_dict(model.state_dict())
    assert torch.equal(rebuilt(x), model(x))


def test_uninitialized_lazy_layers_stay_lazy():
    model = nn.Sequential(
        nn.LazyConv2d(4, 3, stride=2, padding=1, bias=False), nn.Flatten(), nn.LazyLinear(5)
    )
    config = module_to_config(model)
    assert [layer["class_name"] for layer in config["module"]["layers"]] == [
        "LazyConv2d",
        "Flatten",
        "LazyLinear",
    ]
    rebuilt = module_from_config(config)
    x = torch.rand(2, 3, 8, 8)
    rebuilt(x)
    assert rebuilt[0].weight.shape == (4, 3, 3, 3) and rebuilt[0].bias is None
    assert rebuilt[2].weight.shape == (5, 4 * 4 * 4)


LAYERS = [
    nn.Linear(3, 4, bias=False),
    nn.Conv1d(2, 4, 3, stride=2, padding=1, dilation=1, groups=2, bias=False, padding_mode="reflect"),
    nn.Conv2d(2, 6, (3, 5), stride=1, padding="same", dilation=(2, 1), padding_mode="circular"),
    nn.Conv3d(1, 2, 3),
    nn.ConvTranspose2d(2, 3, 3, stride=2, output_padding=1),
    nn.MaxPool2d(3, stride=2, padding=1, dilation=2, ceil_mode=True),
    nn.MaxPool1d(2),
    nn.AvgPool2d((2, 3), stride=1, padding=1, ceil_mode=True, count_include_pad=False, divisor_override=2),
    nn.AvgPool1d(3),
    nn.AdaptiveAvgPool2d((None, 3)),
    nn.AdaptiveAvgPool1d(4),
    nn.AdaptiveMaxPool2d(2, return_indices=True),
    nn.Flatten(2, 3),
    nn.Unflatten(-1, (2, 5)),
    nn.ReLU(inplace=True), nn.ReLU6(), nn.LeakyReLU(0.3), nn.ELU(0.5), nn.SiLU(), nn.GELU(approximate="tanh"),
    nn.Tanh(), nn.Sigmoid(), nn.Softmax(dim=0), nn.LogSoftmax(dim=-1), nn.Identity(),
    nn.Dropout(0.25), nn.Dropout1d(0.1), nn.Dropout2d(0.3, inplace=True),
    nn.BatchNorm1d(5, eps=1e-3, momentum=None, affine=False),
    nn.BatchNorm2d(4, momentum=0.2, track_running_stats=False),
    nn.BatchNorm3d(2),
    nn.LayerNorm((3, 4), eps=1e-6, elementwise_affine=True, bias=False),
    nn.LayerNorm(4, elementwise_affine=False),
    nn.GroupNorm(2, 4, eps=1e-4, affine=False),
    nn.Embedding(10, 3, padding_idx=-2, max_norm=1.5, norm_type=1.0, scale_grad_by_freq=True, sparse=True),
    nn.Linear(2, 2, dtype=torch.float64),
]  # fmt: skip


@pytest.mark.parametrize("layer", LAYERS, ids=lambda layer: repr(layer))
def test_every_supported_layer_round_trips(layer):
    rebuilt = _rebuild(nn.Sequential(layer))[0]
    assert type(rebuilt) is type(layer)
    assert repr(rebuilt) == repr(layer)
    assert _signature(rebuilt) == _signature(layer)
    constants = {k: v for k, v in vars(layer).items() if not k.startswith("_") and k != "training"}
    assert {k: getattr(rebuilt, k) for k in constants} == constants


def test_supported_layers_lists_the_required_ones():
    required = {
        "Linear", "LazyLinear", "Conv1d", "Conv2d", "LazyConv2d", "MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d",
        "Flatten", "Unflatten", "ReLU", "GELU", "Tanh", "Sigmoid", "Softmax", "LogSoftmax", "Dropout",
        "BatchNorm1d", "BatchNorm2d", "LayerNorm", "Embedding", "Identity", "Sequential",
    }  # fmt: skip
    assert required <= set(supported_layers())


def test_nested_containers_keep_names():
    model = nn.Sequential(
        OrderedDict(
            features=nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)),
            heads=nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 3)]),
            extra=nn.ModuleDict({"proj": nn.Linear(3, 1), "act": nn.ReLU()}),
        )
    )
    rebuilt = _rebuild(model)
    assert _signature(rebuilt) == _signature(model)
    assert repr(rebuilt) == repr(model)


class _MyLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class _Custom(nn.Module):
    def forward(self, x):
        return x


def test_unsupported_modules_have_no_config():
    assert module_to_config(nn.Sequential(nn.Linear(2, 2), _Custom())) is None
    assert module_to_config(nn.Sequential(_MyLinear(2, 2))) is None  # subclasses may change forward
    assert module_to_config(_Custom()) is None
    assert module_to_config(nn.Sequential(nn.Linear(2, 2), nn.LSTM(2, 2))) is None
    hooked = nn.Linear(2, 2)
    hooked.register_forward_hook(lambda module, args, output: output * 0)
    assert module_to_config(nn.Sequential(hooked)) is None
    extra = nn.Linear(2, 2)
    extra.register_buffer("scale", torch.ones(1))  # state the config cannot rebuild
    assert module_to_config(extra) is None


def test_errors_name_the_problem():
    with pytest.raises(TypeError, match="Module"):
        module_to_config("not a module")
    with pytest.raises(TypeError, match="dict"):
        module_from_config([1])
    with pytest.raises(ValueError, match="format"):
        module_from_config({"module": {"class_name": "Linear"}})
    config = module_to_config(nn.Sequential(nn.ReLU()))
    config["module"]["layers"][0]["class_name"] = "Transformer"
    with pytest.raises(ValueError, match="Transformer.*module="):
        module_from_config(config)
    config = module_to_config(nn.Linear(2, 3))
    config["module"]["config"]["nonsense"] = 1
    with pytest.raises(ValueError, match="Linear"):
        module_from_config(config)
