"""A meshfit checkpoint skips the CRC-32 of torch.save's zips (each data file carries a CRC-32C of its own,
checked at restore) and leaves torch's setting as the user had it, for the user's own torch.save."""

from __future__ import annotations

import os

import pytest
import torch
from _tamper import flip_bits

from meshfit._storage import ChecksumError
from meshfit.train import Checkpoint, _storage


@pytest.fixture
def crc_option():
    before = torch.serialization.get_crc32_options()
    yield
    torch.serialization.set_crc32_options(before)


def _save_recording_crc(tmp_path, monkeypatch, async_save: bool) -> tuple[list[bool], torch.nn.Module, str]:
    seen: list[bool] = []
    original = torch.save

    def recording(*args, **kwargs):
        seen.append(torch.serialization.get_crc32_options())
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "save", recording)
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    path = str(tmp_path / "ckpt")
    result = Checkpoint(model=model).save(path, async_save=async_save)
    if async_save:
        result.result(timeout=60)
    monkeypatch.setattr(torch, "save", original)
    return seen, model, path


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("users_setting", [True, False])
def test_the_data_zips_skip_crc32_and_the_users_setting_is_kept(tmp_path, monkeypatch, crc_option, async_save,
                                                               users_setting):
    torch.serialization.set_crc32_options(users_setting)
    seen, model, path = _save_recording_crc(tmp_path, monkeypatch, async_save)
    assert seen and not any(seen), seen  # every tensor DCP wrote, without the zip's CRC-32
    assert torch.serialization.get_crc32_options() is users_setting
    # the checkpoint restores what was saved, its own checksums checked
    restored = torch.nn.Linear(5, 3)
    Checkpoint(model=restored).restore(path)
    for a, b in zip(model.parameters(), restored.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_flipped_byte_in_a_data_file_is_still_refused(tmp_path, monkeypatch, crc_option):
    _, _, path = _save_recording_crc(tmp_path, monkeypatch, False)
    data = next(os.path.join(path, n) for n in os.listdir(path) if n.endswith(_storage.DCP_DATA))
    flip_bits(data, mask=0x10)
    with pytest.raises(ChecksumError):
        Checkpoint(model=torch.nn.Linear(5, 3)).restore(path)


def test_concurrent_writes_put_the_setting_back_after_the_last(crc_option):
    torch.serialization.set_crc32_options(True)
    with _storage._zip_crc_skipped():
        with _storage._zip_crc_skipped():
            assert torch.serialization.get_crc32_options() is False
        assert torch.serialization.get_crc32_options() is False  # the outer write still runs
    assert torch.serialization.get_crc32_options() is True
