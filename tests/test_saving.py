"""meshfit._saving._save (Model.save / load_model): checksums, metric objects, errors that name the file, disk full."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from _disk import small_disk
from _tamper import flip_bits

import meshfit as mf
from meshfit._storage._checksum import ChecksumError
from meshfit._storage._chief import ChiefWriteError, chief_writes


def _model() -> mf.Model:
    torch.manual_seed(0)
    model = mf.Model(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)))
    model.compile(mf.optimizers.Adam(learning_rate=0.01), mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[mf.metrics.SparseCategoricalAccuracy(), mf.metrics.SparseTopKCategoricalAccuracy(k=2),
                           "accuracy"])
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return model


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors"])
def test_a_bit_flip_in_a_tensor_file_is_an_error_naming_the_file(tmp_path, name):
    path = str(tmp_path / "saved")
    _model().save(path)
    file = os.path.join(path, name)
    flip_bits(file, os.path.getsize(file) - 6, mask=0x10)  # inside the last tensor's data
    with pytest.raises(ChecksumError, match=name):
        mf.load_model(path)


def test_metric_objects_survive_save_and_load(tmp_path):
    model = _model()
    model.save(tmp_path / "saved")
    restored = mf.load_model(tmp_path / "saved")
    assert restored.metrics_names == model.metrics_names
    kinds = [type(m).__name__ for m in restored.metrics[1:]]
    assert kinds[:2] == ["SparseCategoricalAccuracy", "SparseTopKCategoricalAccuracy"]
    assert restored.metrics[2]._fn_kwargs == {"k": 2}
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    assert restored.evaluate(x, y, verbose=0, return_dict=True) == model.evaluate(x, y, verbose=0, return_dict=True)


def _rename_first_tensor(node) -> bool:
    if isinstance(node, dict) and "tensor" in node:
        node["tensor"] = "absent"
        return True
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else []
    return any(_rename_first_tensor(child) for child in children)


def test_an_unknown_layer_or_bad_optimizer_state_names_the_file(tmp_path):
    path = tmp_path / "saved"
    _model().save(path)
    config = json.loads((path / "config.json").read_text())
    config["architecture"]["module"]["layers"][0]["class_name"] = "Linaer"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json.*Linaer"):
        mf.load_model(path)
    _model().save(path)
    config = json.loads((path / "config.json").read_text())
    _rename_first_tensor(config["optimizer_state"]["tree"])
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"optimizer\.safetensors"):
        mf.load_model(path)


def test_a_non_chief_rank_raises_when_the_chief_failed():
    def fail() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    statuses = ["", "OSError: [Errno 28] No space left on device"]  # what rank 1 gathers
    with pytest.raises(ChiefWriteError, match="No space left on device"):
        chief_writes(fail, is_chief=False, gather=lambda text: statuses, what="save")
    with pytest.raises(OSError, match="No space left"):
        chief_writes(fail, is_chief=True, gather=lambda text: [text], what="save")


@pytest.mark.slow  # starts processes
def test_disk_full_error_names_the_path(tmp_path):
    model = mf.Model(torch.nn.Linear(256, 512))  # 0.5 MiB of weights: larger than the disk
    model.compile("sgd", "mse")
    with small_disk(tmp_path / "disk") as disk:
        target = str(disk / "model")
        with pytest.raises(OSError, match=r"No space left on device") as caught:
            model.save(target)
        assert target in str(caught.value)
        assert os.listdir(disk) == []  # nothing half-written left behind
