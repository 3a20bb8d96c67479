"""Tests for meshfit._saving._weights: safetensors weight files and pickle-free optimizer state."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch
from torch import nn

from meshfit._saving._weights import (
    flatten_optimizer_state,
    load_metadata,
    load_state_dict_file,
    save_state_dict,
    unflatten_optimizer_state,
)


def test_state_dict_round_trip_with_metadata(tmp_path):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {
        "w": base.t(),  # non-contiguous
        "half": torch.ones(2, dtype=torch.float16),
        "count": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0),
        "param": nn.Parameter(torch.randn(3)),
    }
    path = tmp_path / "w.safetensors"
    save_state_dict(path, state, metadata={"format": "meshfit", "step": "3"})
    loaded = load_state_dict_file(str(path))
    assert set(loaded) == set(state)
    for key, tensor in state.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor.detach())
    assert load_metadata(path) == {"format": "meshfit", "step": "3"}
    assert os.listdir(tmp_path) == ["w.safetensors"]


def test_shared_tensors_are_saved_as_copies(tmp_path):
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight  # tied weights
    whole = torch.arange(6.0)
    state = {**model.state_dict(), "first": whole[:3], "second": whole[3:]}
    save_state_dict(tmp_path / "tied.safetensors", state)
    loaded = load_state_dict_file(tmp_path / "tied.safetensors")
    assert set(loaded) == set(state)
    assert torch.equal(loaded["0.weight"], loaded["1.weight"])
    assert torch.equal(loaded["second"], torch.tensor([3.0, 4.0, 5.0]))


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        load_state_dict_file(tmp_path / "nope.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(
        ValueError, match=r"junk.safetensors.*not a meshfit/safetensors checkpoint or corrupted"
    ):
        load_state_dict_file(tmp_path / "junk.safetensors")
    save_state_dict(tmp_path / "good.safetensors", {"w": torch.randn(100)})
    data = (tmp_path / "good.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cut.safetensors"):
        load_state_dict_file(tmp_path / "cut.safetensors")
    with pytest.raises(ValueError, match="junk.safetensors"):
        load_metadata(tmp_path / "junk.safetensors")


def test_save_rejects_bad_input(tmp_path):
    with pytest.raises(TypeError, match="'a'"):
        save_state_dict(tmp_path / "x", {"a": [1, 2]})
    with pytest.raises(TypeError, match="str"):
        save_state_dict(tmp_path / "x", {"a": torch.ones(1)}, metadata={"step": 3})
    assert not (tmp_path / "x").exists()


def _train(model, optimizer, steps, seed):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=generator)
        y = torch.randn(8, 2, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _assert_same_tree(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _assert_same_tree(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same_tree(x, y)
    else:
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0.05),  # momentum_buffer=None
        lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.95)),
        lambda p: torch.optim.AdamW(p, lr=0.01, amsgrad=True),
    ],
    ids=["sgd-momentum", "sgd", "adam", "adamw-amsgrad"],
)
def test_optimizer_state_round_trips_and_resumes_bitwise(tmp_path, make_optimizer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = make_optimizer(model.parameters())
    _train(model, optimizer, steps=3, seed=1)

    tensors, meta = flatten_optimizer_state(optimizer.state_dict())
    meta_json = json.dumps(meta, allow_nan=False)
    save_state_dict(tmp_path / "opt.safetensors", tensors, metadata={"optimizer": meta_json})
    save_state_dict(tmp_path / "model.safetensors", model.state_dict())

    loaded_tensors = load_state_dict_file(tmp_path / "opt.safetensors")
    restored_state = unflatten_optimizer_state(
        loaded_tensors, json.loads(load_metadata(tmp_path / "opt.safetensors")["optimizer"])
    )
    _assert_same_tree(restored_state, optimizer.state_dict())

    resumed_model = copy.deepcopy(model)
    for p in resumed_model.parameters():
        p.data.normal_()  # prove the weights come from the file
    resumed_model.load_state_dict(load_state_dict_file(tmp_path / "model.safetensors"))
    resumed_optimizer = make_optimizer(resumed_model.parameters())
    resumed_optimizer.load_state_dict(restored_state)

    _train(model, optimizer, steps=3, seed=2)
    _train(resumed_model, resumed_optimizer, steps=3, seed=2)
    for original, resumed in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(original, resumed)


def test_flatten_preserves_python_types():
    state = {
        "state": {0: {"step": 3, "buf": None, "t": torch.ones(2)}, 7: {"t": torch.zeros(1)}},
        "param_groups": [{"params": [0, 7], "betas": (0.9, 0.99), "lr": 0.1, "clip": float("inf"),
                          "nan": float("nan"), "name": "g", "flag": True, "scale": torch.tensor(2.0)}],
    }  # fmt: skip
    tensors, meta = flatten_optimizer_state(state)
    assert set(tensors) == {"state/0/t", "state/7/t", "param_groups/0/scale"}
    restored = unflatten_optimizer_state(tensors, json.loads(json.dumps(meta, allow_nan=False)))
    _assert_same_tree(restored, state)


def test_flatten_and_unflatten_reject_bad_input():
    with pytest.raises(TypeError, match=r"state/0/bad.*object"):
        flatten_optimizer_state({"state": {0: {"bad": object()}}})
    with pytest.raises(TypeError, match="list"):
        flatten_optimizer_state([1, 2])
    with pytest.raises(ValueError, match="format"):
        unflatten_optimizer_state({}, {"tree": {}})
    _, meta = flatten_optimizer_state({"state": {0: {"t": torch.ones(1)}}})
    with pytest.raises(ValueError, match="state/0/t"):
        unflatten_optimizer_state({}, meta)
