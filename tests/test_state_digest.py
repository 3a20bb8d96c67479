"""`mf.train.state_digest`: one 64-bit value per tensor and for the state, the same in every layout."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from _interrupt import InterruptAtStepBegin
from _multiproc import run_distributed
from torch import nn

import meshfit as mf


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "even": torch.randn(8, 6),            # splits evenly on 2 and 4 processes
        "uneven": torch.randn(5, 3),          # 5 rows on 4 processes: 2, 2, 1, 0
        "wide": torch.randn(2, 70_000),       # crosses key rows: the blocked path and both partial ones
        "wide64": torch.randn(4, 4, dtype=torch.float64),
        "brain16": torch.randn(6, 2).to(torch.bfloat16),
        "count": torch.arange(12, dtype=torch.int64).reshape(4, 3),
    }


class _Holder(nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, value in tensors.items():
            self.register_buffer(name, value)


def _digest_of(tensors: dict[str, torch.Tensor]) -> mf.distribute.StateDigest:
    return mf.train.state_digest(_Holder(tensors))


def test_a_single_element_change_changes_that_tensor_and_the_total_only():
    base = _digest_of(_tensors())
    assert base == _digest_of(_tensors()) and base.total == _digest_of(_tensors()).total
    for name, tensor in _tensors().items():
        for index in (0, tensor.numel() - 1, tensor.numel() // 2):
            changed = _tensors()
            flat = changed[name].view(-1)
            flat.view(torch.uint8)[index * flat.element_size()] ^= 1  # one bit of one element
            digest = _digest_of(changed)
            assert digest[name] != base[name], (name, index)
            assert all(digest[k] == base[k] for k in base if k != name)
            assert digest.total != base.total


def test_order_shape_dtype_and_path_all_count():
    base = _digest_of(_tensors())
    swapped = _tensors()
    swapped["even"][0, 0], swapped["even"][0, 1] = swapped["even"][0, 1].clone(), swapped["even"][0, 0].clone()
    assert _digest_of(swapped)["even"] != base["even"]
    rolled = _tensors()
    rolled["wide"] = rolled["wide"].roll(1)  # every value one place on: a shard loaded in the wrong place
    assert _digest_of(rolled)["wide"] != base["wide"]
    reshaped = _tensors()
    reshaped["even"] = reshaped["even"].reshape(6, 8)
    assert _digest_of(reshaped)["even"] != base["even"]
    assert _digest_of({"a": torch.zeros(4)})["a"] != _digest_of({"a": torch.zeros(4, dtype=torch.int32)})["a"]
    renamed = _digest_of({"b": _tensors()["even"]})
    assert renamed["b"] == base["even"] and renamed.total != _digest_of({"even": _tensors()["even"]}).total
    # the total does not depend on the order the tensors come in
    assert _digest_of(dict(reversed(list(_tensors().items())))).total == base.total


def test_a_model_and_its_optimizer_state_by_parameter_path():
    torch.manual_seed(0)
    model = mf.Model(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)))
    model.compile(mf.optimizers.Adam(0.01), mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(torch.randn(16, 3).numpy(), torch.randint(0, 2, (16,)).numpy(), batch_size=8, verbose=0)
    digest = mf.train.state_digest(model)
    assert {"0.weight", "1.running_mean", "1.num_batches_tracked", "optimizer/iterations",
            "optimizer/0.weight/exp_avg", "optimizer/2.bias/exp_avg_sq", "optimizer/2.bias/step"} <= set(digest)
    assert all(0 <= value < 2 ** 64 for value in digest.values())
    assert mf.train.state_digest(model.module).keys() == {k for k in digest if not k.startswith("optimizer/")}
    # a torch optimizer's state is named the same way
    torch_optimizer = torch.optim.SGD(model.module.parameters(), lr=0.1, momentum=0.9)
    model.module(torch.randn(4, 3)).sum().backward()
    torch_optimizer.step()
    assert "optimizer/2.weight/momentum_buffer" in mf.train.state_digest(model.module, torch_optimizer)


def test_bad_input_names_the_argument_and_the_fix():
    with pytest.raises(ValueError, match=r"`model`.*holds no tensors.*built"):
        mf.train.state_digest(nn.ReLU())
    with pytest.raises(ValueError, match=r"`model`.*holds no tensors"):
        mf.train.state_digest(nn.Sequential(nn.LazyLinear(3)))
    with pytest.raises(TypeError, match=r"Invalid `model`: expected a meshfit.Model or a torch.nn.Module"):
        mf.train.state_digest({"weight": torch.zeros(2)})
    with pytest.raises(TypeError, match=r"Invalid `optimizer`"):
        mf.train.state_digest(nn.Linear(2, 1), optimizer="adam")


def _layouts(rank: int, world: int) -> dict[str, dict[str, int]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = {"replicated": dict(_digest_of(_tensors()))}
    line = init_device_mesh("cpu", (world,), mesh_dim_names=("batch",))
    square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("batch", "model"))
    layouts = {
        "rows on 4": (line, [Shard(0)]),                       # fully sharded on 4 processes
        "columns on 4": (line, [Shard(1)]),                    # blocks that are not one flat range
        "(2, 2) rows x columns": (square, [Shard(0), Shard(1)]),
        "(2, 2) replicated x columns": (square, [Replicate(), Shard(1)]),
        "(2, 2) rows x replicated": (square, [Shard(0), Replicate()]),
    }
    for label, (mesh, placements) in layouts.items():
        sharded = {name: distribute_tensor(t, mesh, placements) for name, t in _tensors().items()}
        out[label] = dict(_digest_of(sharded))
    # a module fully sharded with torch's fully_shard (FSDP2), as LayoutMap.fully_sharded does
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))
    fully_shard(module, mesh=line)
    out["fully_shard"] = dict(mf.train.state_digest(module))
    # a (1, 2) mesh: processes 2 and 3 hold nothing of these tensors
    pair = torch.distributed.device_mesh.DeviceMesh("cpu", [[0, 1]], mesh_dim_names=("batch", "model"))
    out["(1, 2) on two of four"] = dict(_digest_of({n: distribute_tensor(t, pair, [Replicate(), Shard(0)])
                                                     for n, t in _tensors().items()}))
    return out


def test_the_digest_is_the_same_in_one_process_replicated_fully_sharded_and_on_2d_meshes():
    expected = dict(_digest_of(_tensors()))
    torch.manual_seed(0)
    plain = dict(mf.train.state_digest(nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))))
    results = run_distributed(_layouts, world_size=4, timeout=240)
    for rank, by_layout in enumerate(results):
        for label, digest in by_layout.items():
            assert digest == (plain if label == "fully_shard" else expected), (rank, label)


# ---- every save records the digest; every restore recomputes it ---------------------------------------
def _copy_data_files(donor: str, target: str) -> None:
    """Give ``target`` the donor checkpoint's data files, and their checksums: valid files, other values."""
    for name in os.listdir(donor):
        if name.endswith(".distcp") or name == ".metadata":
            shutil.copyfile(os.path.join(donor, name), os.path.join(target, name))
    with open(os.path.join(donor, "meshfit_state.json")) as f:
        checksums = json.load(f)["checksums"]
    with open(os.path.join(target, "meshfit_state.json")) as f:
        document = json.load(f)
    document["checksums"] = checksums
    with open(os.path.join(target, "meshfit_state.json"), "w") as f:
        json.dump(document, f)


def test_a_checkpoint_rewritten_with_valid_checksums_but_other_values_is_refused_by_name(tmp_path):
    from meshfit.train import Checkpoint

    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    saved = Checkpoint(model=layer).save(tmp_path / "ckpt-1")
    with open(os.path.join(saved, "meshfit_state.json")) as f:
        assert set(json.load(f)["digest"]["tensors"]) == {"weight", "bias"}  # state_digest's names
    with torch.no_grad():
        layer.weight.add_(1.0)
    donor = Checkpoint(model=layer).save(tmp_path / "other")
    _copy_data_files(donor, saved)
    with pytest.raises(ValueError, match=r"ckpt-1.*tensor 'weight' \(stored as 'model/weight'\) was loaded with "
                                         r"digest 0x[0-9a-f]{16}, "
                                         r"but the save recorded 0x[0-9a-f]{16}") as refused:
        Checkpoint(model=nn.Linear(3, 2)).restore(saved)
    assert type(refused.value).__name__ == "DigestMismatchError"


def _fit_mlp(callbacks) -> mf.Model:
    torch.manual_seed(0)
    model = mf.Model(nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 10)))
    model.compile(mf.optimizers.Adam(0.01), mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    (x, y), _ = mf.datasets.load_digits()
    data = mf.data.Dataset.from_tensor_slices((x[:320], y[:320])).shuffle(320, seed=2).batch(32)
    model.fit(data, epochs=1, verbose=0, callbacks=callbacks)
    return model


def test_a_tampered_backup_is_skipped_by_name_for_the_previous_one_ending_bitwise_equal(tmp_path):
    reference = _fit_mlp([])
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="Interruption"):
        _fit_mlp([mf.callbacks.BackupAndRestore(backup, save_freq=2, async_save=False), InterruptAtStepBegin(7)])
    latest = mf.train.latest_checkpoint(backup)
    assert latest.endswith("ckpt-3")
    _copy_data_files(os.path.join(backup, "ckpt-2"), latest)  # step 4's values under step 6's name
    callback = mf.callbacks.BackupAndRestore(backup, save_freq=2, delete_checkpoint=False)
    with pytest.warns(RuntimeWarning, match=r"Skipping the corrupt backup .*ckpt-3.*was loaded with digest"):
        resumed = _fit_mlp([callback])
    assert callback.restored_from.endswith("ckpt-2")
    for a, b in zip(resumed.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


# ---- a shard loaded into the wrong place ---------------------------------------------------------------
def _sharded_module() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    fully_shard(module, mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("batch",)))
    return module


def _save_sharded(rank: int, world: int, path: str) -> str:
    from meshfit.train import Checkpoint

    return Checkpoint(model=_sharded_module()).save(path)


def _restore_sharded(rank: int, world: int, path: str) -> str:
    from meshfit.train import Checkpoint

    module = _sharded_module()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.zero_()
    try:
        Checkpoint(model=module).restore(path)
    except Exception as error:  # noqa: BLE001 - reported to the parent, which checks its type and words
        return f"{type(error).__name__}: {error}"
    return "restored"


def test_a_shard_loaded_into_the_wrong_place_is_refused_by_name(tmp_path):
    """The checkpoint's index is rewritten so that the first weight's two row shards swap places (each
    read from the other's bytes), and its checksum recorded again: every file is valid, every value is
    one that was saved, and only the digest of what was loaded can tell."""
    import pickle

    from torch.distributed.checkpoint.metadata import MetadataIndex

    from meshfit._storage._checksum import file_crc32

    saved = run_distributed(_save_sharded, world_size=2, args=(str(tmp_path / "ckpt-1"),), timeout=240)[0]
    assert run_distributed(_restore_sharded, world_size=2, args=(saved,), timeout=240) == ["restored"] * 2
    index_path = os.path.join(saved, ".metadata")
    with open(index_path, "rb") as f:
        index = pickle.load(f)  # noqa: S301 - the test's own file, written just above
    storage = index.storage_data
    name = next(key.fqn for key in storage if key.fqn.endswith("0.weight"))
    top, bottom = MetadataIndex(name, torch.Size([0, 0])), MetadataIndex(name, torch.Size([2, 0]))
    storage[top], storage[bottom] = storage[bottom], storage[top]
    with open(index_path, "wb") as f:
        pickle.dump(index, f)
    with open(os.path.join(saved, "meshfit_state.json")) as f:
        document = json.load(f)
    document["checksums"][".metadata"] = file_crc32(index_path)
    with open(os.path.join(saved, "meshfit_state.json"), "w") as f:
        json.dump(document, f)
    results = run_distributed(_restore_sharded, world_size=2, args=(saved,), timeout=240)
    for message in results:
        assert message.startswith("DigestMismatchError"), message
        assert "ckpt-1" in message and "0.weight" in message, message


def test_a_backup_records_the_digest_under_state_digests_names_with_its_total(tmp_path):
    """The digest a backup records and `meshfit.train.state_digest` of the model at that step use the
    same keys (module paths; ``optimizer/<param path>/<state>``; ``optimizer/iterations``) and total."""
    from meshfit.train import state_digest

    torch.manual_seed(0)
    model = mf.Model(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))
    model.compile(optimizer=mf.optimizers.Adam(0.01), loss="mse")
    seen = {}
    record = mf.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.setdefault(model.optimizer.iterations, state_digest(model)))
    x, y = np.random.default_rng(0).normal(size=(32, 4)), np.random.default_rng(1).normal(size=(32, 2))
    model.fit(x.astype("float32"), y.astype("float32"), batch_size=8, epochs=1, verbose=0,
              callbacks=[record, mf.callbacks.BackupAndRestore(tmp_path, save_freq=2, delete_checkpoint=False)])
    with open(tmp_path / "ckpt-2" / "meshfit_state.json") as f:
        recorded = json.load(f)["digest"]
    at_step_4 = seen[4]
    assert set(recorded["tensors"]) == set(at_step_4)
    assert {k: int(v, 16) for k, v in recorded["tensors"].items()} == dict(at_step_4)
    assert int(recorded["total"], 16) == at_step_4.total
    assert recorded["keys"]["optimizer/0.weight/exp_avg"] == "optimizer/optimizer/state/0/exp_avg"


def test_a_shared_tensor_some_ranks_lack_is_a_divergence_not_left_out():
    """Replicas whose optimizer state differs in which tensors exist have diverged: the save names the
    tensor and the ranks that lack it (before, the record silently left it out)."""
    from meshfit.train._digest import agreed_record

    full = {"model/w": [5, [], True, 1], "optimizer/exp_avg": [7, [], True, 2]}
    lacking = {"model/w": [5, [], True, 1]}
    for gathered, ranks in (([full, lacking], [1]), ([lacking, full], [0])):
        with pytest.raises(mf.ReplicaDivergenceError, match=r"Cannot checkpoint 'optimizer'.*'optimizer/exp_avg' "
                                                            r"differs on rank\(s\) " + str(ranks[0])) as refused:
            agreed_record(gathered, set(), {"model/w": "model", "optimizer/exp_avg": "optimizer"}, 3)
        assert refused.value.ranks == ranks and refused.value.step == 3
    assert set(agreed_record([full, full], set(), {}, 3)["tensors"]) == {"model/w", "optimizer/exp_avg"}
