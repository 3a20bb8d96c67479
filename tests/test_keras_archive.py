"""model.save("x.keras"): one zip of safetensors + JSON that load_model reads; the directory format stays."""

from __future__ import annotations

import json
import os
import zipfile

import numpy as np
import pytest
import torch
from _multiproc import run_distributed
from torch import nn

import meshfit as mf


def _trained(seed: int = 0) -> tuple[mf.Model, np.ndarray, np.ndarray]:
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Flatten(), nn.LazyLinear(16), nn.ReLU(), nn.Linear(16, 10))
    model = mf.Model(module)
    model.compile(mf.optimizers.Adam(learning_rate=0.01), mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    (x, y), _ = mf.datasets.load_digits()
    x, y = x[:128], y[:128]
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    return model, x, y


def test_keras_file_is_one_zip_of_safetensors_and_json(tmp_path):
    model, x, y = _trained()
    path = tmp_path / "model.keras"
    model.save(str(path))
    assert sorted(os.listdir(tmp_path)) == ["model.keras"]  # one file, no staging or temp leftovers
    with zipfile.ZipFile(path) as archive:
        names = sorted(archive.namelist())
        assert names == ["config.json", "metadata.json", "model.safetensors", "optimizer.safetensors"]
        assert json.loads(archive.read("metadata.json"))["format"] == "meshfit.keras/1"
        assert json.loads(archive.read("config.json"))["compile"]["loss"]["class_name"] == \
            "SparseCategoricalCrossentropy"
        for name in names:  # nothing pickled: pickles start with the PROTO opcode 0x80
            assert not archive.read(name).startswith(b"\x80")

    # The same files as today's directory format, byte for byte apart from the metadata.
    model.save(str(tmp_path / "as_directory"))
    with zipfile.ZipFile(path) as archive:
        for name in ["model.safetensors", "optimizer.safetensors", "config.json"]:
            assert archive.read(name) == (tmp_path / "as_directory" / name).read_bytes(), name

    restored = mf.load_model(str(path))
    np.testing.assert_array_equal(restored.predict(x, verbose=0), model.predict(x, verbose=0))
    assert restored.optimizer.learning_rate == pytest.approx(0.01)
    saved_state = model.optimizer.state_dict()["optimizer"]["state"]
    restored_state = restored.optimizer.state_dict()["optimizer"]["state"]
    for key in saved_state:
        assert torch.equal(saved_state[key]["exp_avg"], restored_state[key]["exp_avg"])
    # Training continues from the restored optimizer exactly as from the original.
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    restored.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), restored.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)

    from_directory = mf.load_model(str(tmp_path / "as_directory"))
    assert from_directory.count_params() == model.count_params()


def test_load_weights_from_a_keras_file_and_overwrite(tmp_path):
    model, x, _ = _trained(seed=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    other, _, _ = _trained(seed=1)
    assert not np.array_equal(other.get_weights()[0], model.get_weights()[0])
    other.load_weights(path)
    for a, b in zip(other.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    other.save(path)  # overwrite in place: still one file, now other's weights
    np.testing.assert_array_equal(mf.load_model(path).predict(x, verbose=0), other.predict(x, verbose=0))
    assert sorted(os.listdir(tmp_path)) == ["m.keras"]


def test_bad_keras_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="No saved model at"):
        mf.load_model(str(tmp_path / "missing.keras"))
    (tmp_path / "text.keras").write_text("not a zip")
    with pytest.raises(ValueError, match="not a zip file"):
        mf.load_model(str(tmp_path / "text.keras"))
    with zipfile.ZipFile(tmp_path / "other.keras", "w") as archive:
        archive.writestr("metadata.json", json.dumps({"format": "keras"}))
    with pytest.raises(ValueError, match="format 'keras'"):
        mf.load_model(str(tmp_path / "other.keras"))
    with zipfile.ZipFile(tmp_path / "partial.keras", "w") as archive:
        archive.writestr("metadata.json", json.dumps({"format": "meshfit.keras/1"}))
        archive.writestr("../../escape.json", "{}")
    with pytest.raises(ValueError, match=r"incomplete .keras archive: \['config.json', 'model.safetensors'\]"):
        mf.load_model(str(tmp_path / "partial.keras"))
    assert not (tmp_path.parent / "escape.json").exists()
    lazy = mf.Model(nn.Sequential(nn.LazyLinear(2)))
    with pytest.raises(ValueError, match="lazy, uninitialised parameters"):
        lazy.save(str(tmp_path / "lazy.keras"))
    assert not (tmp_path / "lazy.keras").exists()


def _worker_save(rank: int, world: int, directory: str):
    strategy = mf.MultiWorkerMirroredStrategy()
    with strategy.scope():
        torch.manual_seed(0)
        model = mf.Model(nn.Sequential(nn.Linear(4, 3)))
        model.compile("sgd", "mse")
    x = np.arange(32, dtype="float32").reshape(8, 4) / 32
    model.fit(x, np.zeros((8, 3), "float32"), batch_size=4, epochs=1, verbose=0)
    model.save(os.path.join(directory, "shared.keras"))  # every worker, one path
    return model.get_weights()


def test_every_worker_saving_one_keras_path_leaves_one_complete_file(tmp_path):
    weights, _ = run_distributed(_worker_save, world_size=2, args=(str(tmp_path),), timeout=180)
    assert sorted(os.listdir(tmp_path)) == ["shared.keras"]
    restored = mf.load_model(str(tmp_path / "shared.keras"))
    for a, b in zip(restored.get_weights(), weights, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_directory_saved_under_a_keras_name_still_loads(tmp_path):
    model, x, _ = _trained()
    old_style = tmp_path / "old.keras"
    model.save(str(tmp_path / "directory"))
    os.rename(tmp_path / "directory", old_style)  # what model.save("old.keras") wrote before the zip format
    np.testing.assert_array_equal(mf.load_model(str(old_style)).predict(x, verbose=0), model.predict(x, verbose=0))
