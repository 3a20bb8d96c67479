"""A backup that does not fit the run resuming from it is refused, naming the folder, the difference and the fix."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from _interrupt import InterruptAtStepBegin
from torch import nn

import meshfit as mf


@pytest.fixture(scope="module")
def data():
    (x, y), _ = mf.datasets.load_digits()
    return x[:256], y[:256]


def _model(width: int = 16, extra_layer: bool = False) -> mf.Model:
    torch.manual_seed(0)
    layers = [nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10)]
    if extra_layer:
        layers.append(nn.Linear(10, 10))
    model = mf.Model(nn.Sequential(*layers))
    model.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _pipeline(x, y, examples=256, batch=32, drop_remainder=False, buffer=256):
    return (mf.data.Dataset.from_tensor_slices((x[:examples], y[:examples])).shuffle(buffer, seed=2)
            .batch(batch, drop_remainder=drop_remainder))


def _interrupted_backup(data, backup: str, **pipeline) -> None:
    x, y = data
    with pytest.raises(RuntimeError, match="Interruption"):
        _model().fit(_pipeline(x, y, **pipeline), epochs=2, verbose=0,
                     callbacks=[mf.callbacks.BackupAndRestore(backup, save_freq=3, async_save=False), InterruptAtStepBegin(5)])


def _resume(model: mf.Model, dataset, backup: str, **fit) -> None:
    model.fit(dataset, epochs=2, verbose=0, callbacks=[mf.callbacks.BackupAndRestore(backup, save_freq=3)], **fit)


@pytest.mark.parametrize(("change", "expected"), [
    ({"batch": 64}, "global batch size: saved 32, now 64"),
    ({"examples": 224}, "examples per pass (the dataset's length): saved 256, now 224"),
    ({"drop_remainder": True, "examples": 250}, "drop_remainder: saved False, now True"),
    ({"buffer": 100}, "shuffle buffer sizes: saved [256], now [100]"),
])
def test_a_resume_on_other_data_is_refused_naming_both_values_and_the_fix(data, tmp_path, change, expected):
    backup = str(tmp_path / "backup")
    _interrupted_backup(data, backup, **({"examples": 250} if "drop_remainder" in change else {}))
    x, y = data
    with pytest.raises(ValueError) as refused:
        _resume(_model(), _pipeline(x, y, **change), backup)
    message = str(refused.value)
    assert expected in message, message
    assert f"cannot resume from {backup!r}" in message, message
    assert "another `backup_dir`" in message and f"delete {backup!r}" in message, message
    assert os.path.isdir(backup)  # nothing deleted: the user decides


def test_array_input_with_another_batch_size_is_refused(data, tmp_path):
    x, y = data
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="Interruption"):
        _model().fit(x, y, batch_size=32, epochs=2, verbose=0,
                     callbacks=[mf.callbacks.BackupAndRestore(backup, save_freq=3, async_save=False), InterruptAtStepBegin(5)])
    with pytest.raises(ValueError, match=r"global batch size: saved 32, now 16"):
        _model().fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[mf.callbacks.BackupAndRestore(backup)])


def test_the_same_data_resumes_and_the_backup_records_its_topology(data, tmp_path):
    backup = str(tmp_path / "backup")
    _interrupted_backup(data, backup)
    state = json.load(open(os.path.join(backup, "ckpt-1", "meshfit_state.json")))
    text = json.dumps(state["trackables"]["loop"])
    for field in ("examples", "global_batch_size", "drop_remainder", "shuffle_buffers", "world_size"):
        assert field in text, text
    x, y = data
    model = _model()
    _resume(model, _pipeline(x, y), backup)
    assert model.loop_state.iterations == 16


@pytest.mark.parametrize("kind", ["wider", "deeper"])
def test_a_stale_backup_after_the_model_changed_names_the_folder_the_parameter_and_the_fix(data, tmp_path, kind):
    backup = str(tmp_path / "backup")
    _interrupted_backup(data, backup)
    x, y = data
    model = _model(width=24) if kind == "wider" else _model(extra_layer=True)
    with pytest.raises(ValueError) as refused:
        _resume(model, _pipeline(x, y), backup)
    message = str(refused.value)
    if kind == "wider":
        assert re.search(r"parameter '1\.weight' has shape \(16, 64\) in the checkpoint and \(24, 64\) in the "
                         r"module", message), message
    else:
        assert "the module has '4.bias', '4.weight', which the checkpoint lacks" in message, message
    assert "size mismatch" not in message
    assert f"cannot resume from {backup!r}" in message and os.path.join(backup, "ckpt-") in message, message
    assert "another `backup_dir`" in message and f"delete {backup!r}" in message, message


def test_checkpoint_restore_into_another_module_names_the_parameter(tmp_path):
    from meshfit.train import Checkpoint

    path = Checkpoint(model=nn.Linear(4, 2)).save(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"'model': parameter 'weight' has shape \(2, 4\) in the checkpoint "
                                         r"and \(3, 4\) in the module"):
        Checkpoint(model=nn.Linear(4, 3)).restore(path)
