"""Small replicated state is written by the chief alone (one data file); large or sharded state is split."""

from __future__ import annotations

import os

import torch
from _multiproc import run_distributed
from torch import nn

import meshfit as mf
from meshfit.train import _chief_alone


def _data_files(path: str) -> list[str]:
    return sorted(name for name in os.listdir(path) if name.endswith(".distcp"))


def _save_and_restore(rank: int, world: int, root: str, limit: int | None) -> dict:
    if limit is not None:
        _chief_alone.CHIEF_ALONE_BYTES = limit
    torch.manual_seed(0)  # the same weights on every rank: replicated state
    module = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    mine = torch.full((5,), float(rank + 1))  # differs per rank
    checkpoint = mf.train.Checkpoint(model=module, mine=mf.train.PerRank(mine))
    saved = {k: v.clone() for k, v in module.state_dict().items()}
    listings = {}
    for name, async_save in (("sync", False), ("async", True)):
        path = os.path.join(root, name)
        result = checkpoint.save(path, async_save=async_save)
        if async_save:
            result = result.result()
        listings[name] = _data_files(result)
        with torch.no_grad():  # move away from the saved state, then restore it
            for parameter in module.parameters():
                parameter.add_(1.0)
            mine.zero_()
        checkpoint.restore(result)
        listings[name + " restored"] = (all(torch.equal(saved[k], v) for k, v in module.state_dict().items()),
                                        mine.tolist())
    return listings


def test_a_small_replicated_state_is_written_by_the_chief_alone_and_restores_on_every_rank(tmp_path):
    results = run_distributed(_save_and_restore, world_size=2, args=(str(tmp_path), None), timeout=180)
    for rank, result in enumerate(results):
        for variant in ("sync", "async"):
            assert result[variant] == ["__0_0.distcp"]  # one data file: no rank but the chief wrote
            exact, mine = result[variant + " restored"]
            assert exact  # the weights, bitwise
            assert mine == [float(rank + 1)] * 5  # each rank's own PerRank state, gathered to the chief's file


def test_above_the_limit_every_rank_writes_its_part(tmp_path):
    results = run_distributed(_save_and_restore, world_size=2, args=(str(tmp_path), 0), timeout=180)
    for rank, result in enumerate(results):
        for variant in ("sync", "async"):
            assert result[variant] == ["__0_0.distcp", "__1_0.distcp"]  # DCP's split
            assert result[variant + " restored"] == (True, [float(rank + 1)] * 5)


def _split_then_alone(rank: int, world: int, root: str) -> list:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))  # no per-rank state
    checkpoint = mf.train.Checkpoint(model=module)
    saved = {k: v.clone() for k, v in module.state_dict().items()}
    limit = _chief_alone.CHIEF_ALONE_BYTES
    out = []
    for name, alone_limit in (("split", 0), ("alone", limit), ("split-again", 0)):
        _chief_alone.CHIEF_ALONE_BYTES = alone_limit
        target = os.path.join(root, name)  # the chief-alone save asynchronous: no per-rank tensor to stage
        path = checkpoint.save(target, async_save=True).result() if name == "alone" else checkpoint.save(target)
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.add_(1.0)
        checkpoint.restore(path)
        out.append((_data_files(path), all(torch.equal(saved[k], v) for k, v in module.state_dict().items())))
    return out


def test_saves_with_and_without_the_group_do_not_share_dcps_cached_plans(tmp_path):
    """The same tensors saved split, then by the chief alone, then split: each checkpoint holds all of them."""
    results = run_distributed(_split_then_alone, world_size=2, args=(str(tmp_path),), timeout=180)
    for result in results:
        assert result == [(["__0_0.distcp", "__1_0.distcp"], True), (["__0_0.distcp"], True),
                          (["__0_0.distcp", "__1_0.distcp"], True)]


def test_the_limit_counts_bytes():
    assert _chief_alone.chief_can_write_alone({"a": torch.zeros(4), "b": torch.zeros(2, dtype=torch.int64)})
    limit = _chief_alone.CHIEF_ALONE_BYTES
    assert _chief_alone.chief_can_write_alone({"a": torch.empty(limit, dtype=torch.uint8)})
    assert not _chief_alone.chief_can_write_alone({"a": torch.empty(limit // 2 + 1, dtype=torch.uint8),
                                                   "b": torch.empty(limit // 2, dtype=torch.uint8)})


def test_per_rank_tensors_travel_as_safetensors_or_torch_save_for_other_dtypes():
    plain = {"rng": torch.arange(7, dtype=torch.uint8), "total": torch.tensor(2.5)}
    odd = {"z": torch.tensor([1 + 2j], dtype=torch.complex128)}  # no safetensors dtype
    for tensors, tag in ((plain, b"S"), (odd, b"P")):
        blob = _chief_alone._encode(tensors)
        assert blob[:1] == tag
        back = _chief_alone._decode(blob)
        assert sorted(back) == sorted(tensors)
        assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())
