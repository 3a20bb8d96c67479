"""meshfit.train: Checkpoint, CheckpointManager, latest_checkpoint, PerRank, async saves."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch._dynamo  # noqa: F401  (see below)
import torch.distributed as dist
from _multiproc import run_distributed
from _procs import exit_code_of
from _tamper import flip_bits

from meshfit.train import Checkpoint, CheckpointManager, PerRank, latest_checkpoint, load_checkpoint
from tests._trackables import Position

# torch sets TORCHINDUCTOR_CACHE_DIR the first time torch._dynamo is imported, which building a torch
# optimizer does; importing it here keeps the env-leak guard from blaming the first optimizer test.


class _Everything:
    """A trackable whose state dict holds every supported kind of leaf."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def _model_and_optimizer(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    if kind == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(4, 3, generator=generator)
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()


def _dir_names(directory) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_resume_is_bitwise_equal_to_uninterrupted_run(tmp_path, kind):
    model, optimizer = _model_and_optimizer(kind)
    for step in range(3):
        _train_step(model, optimizer, step)
    path = Checkpoint(model=model, optimizer=optimizer).save(tmp_path / "ckpt")

    resumed_model, resumed_optimizer = _model_and_optimizer(kind)
    Checkpoint(model=resumed_model, optimizer=resumed_optimizer).restore(path)
    assert list(resumed_optimizer.state_dict()["state"]) == list(optimizer.state_dict()["state"])
    for step in range(3, 6):
        _train_step(model, optimizer, step)
        _train_step(resumed_model, resumed_optimizer, step)
    for expected, got in zip(model.state_dict().values(), resumed_model.state_dict().values(), strict=True):
        assert torch.equal(expected, got)
    assert resumed_optimizer.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]


def test_non_tensor_values_round_trip_as_json_with_their_types(tmp_path):
    import numpy as np

    state = {"ints": {0: 1, 7: -2}, "mixed": {"0": "str key", 0: "int key"}, "pair": (0.9, 0.999),
             "flags": [True, False, None], "blob": b"\x00\xffraw", "nan": float("inf"),
             "rng": torch.get_rng_state(), "array": np.arange(3, dtype=np.int32), "nested": [{"a": (1,)}]}
    path = Checkpoint(things=_Everything(state)).save(tmp_path / "ckpt")
    restored = _Everything({})
    Checkpoint(things=restored).restore(path)
    got = restored.state
    assert got["ints"] == {0: 1, 7: -2} and got["mixed"] == {"0": "str key", 0: "int key"}
    assert got["pair"] == (0.9, 0.999) and isinstance(got["pair"], tuple)
    assert got["flags"] == [True, False, None] and got["blob"] == b"\x00\xffraw"
    assert got["nan"] == float("inf") and got["nested"] == [{"a": (1,)}]
    assert torch.equal(got["rng"], state["rng"])
    assert isinstance(got["array"], np.ndarray) and got["array"].tolist() == [0, 1, 2]
    with open(os.path.join(path, "meshfit_state.json")) as f:
        assert json.load(f)["trackables"]["things"]["per_rank"] is False


def test_plain_tensor_is_restored_in_place(tmp_path):
    counter = torch.tensor([5, 6])
    path = Checkpoint(counter=counter).save(tmp_path / "ckpt")
    counter.zero_()
    Checkpoint(counter=counter).restore(path)
    assert counter.tolist() == [5, 6]
    counter.fill_(9)
    assert Checkpoint(counter=counter).save(path) == path  # replaces the old one, leaves no scratch
    assert _dir_names(tmp_path) == ["ckpt"]
    counter.zero_()
    Checkpoint(counter=counter).restore(path)
    assert counter.tolist() == [9, 9]


def test_docstring_examples_run():
    import doctest

    from meshfit.train import _checkpoint, _manager, _per_rank

    for module in (_checkpoint, _manager, _per_rank):
        assert doctest.testmod(module).failed == 0


def test_values_that_would_need_pickle_are_refused(tmp_path):
    with pytest.raises(TypeError, match=r"things\['s'\].*set"):
        Checkpoint(things=_Everything({"s": {1, 2}})).save(tmp_path / "ckpt")
    with pytest.raises(TypeError, match="Invalid trackable `x`.*int"):
        Checkpoint(x=3)


def test_restore_of_a_missing_path_lists_what_exists(tmp_path):
    Checkpoint(p=Position(1)).save(tmp_path / "ckpt-1")
    missing = tmp_path / "ckpt-9"
    with pytest.raises(FileNotFoundError, match=r"ckpt-9.*\['ckpt-1'\]"):
        Checkpoint(p=Position()).restore(missing)


def test_restore_of_an_incomplete_or_mismatched_checkpoint_raises(tmp_path):
    path = Checkpoint(p=Position(1)).save(tmp_path / "ckpt-1")
    with pytest.raises(ValueError, match="no entry 'q'"):
        Checkpoint(q=Position()).restore(path)
    with pytest.raises(ValueError, match="per_rank"):
        Checkpoint(p=PerRank(Position())).restore(path)
    os.remove(os.path.join(path, ".metadata"))
    with pytest.raises(ValueError, match=r"ckpt-1.*not a complete meshfit checkpoint"):
        Checkpoint(p=Position()).restore(path)


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_restore_never_unpickles_arbitrary_objects(tmp_path):
    path = Checkpoint(p=Position(1)).save(tmp_path / "ckpt-1")
    marker = str(tmp_path / "pwned")
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Exploit(marker), f)
    with pytest.raises(ValueError, match="unreadable DCP metadata"):
        Checkpoint(p=Position()).restore(path)
    assert not os.path.exists(marker)


def test_manager_numbers_prunes_and_writes_its_state_file(tmp_path):
    position = Position()
    manager = CheckpointManager(Checkpoint(p=position), tmp_path, max_to_keep=2)
    assert manager.restore_or_initialize() is None and manager.latest_checkpoint is None
    for value in range(1, 5):
        position.value = value
        manager.save()
    names = [os.path.basename(p) for p in manager.checkpoints]
    assert names == ["ckpt-3", "ckpt-4"]
    assert _dir_names(tmp_path) == ["checkpoint", "ckpt-3", "ckpt-4"]
    with open(tmp_path / "checkpoint") as f:
        state = json.load(f)
    assert (state["latest_checkpoint"], state["all_checkpoints"]) == ("ckpt-4", ["ckpt-3", "ckpt-4"])
    assert len(state["all_checkpoint_timestamps"]) == 2 and state["preserved_checkpoints"] == []

    # A new manager (after a crash) recovers from disk, continues numbering and restores the latest.
    position.value = 0
    recovered = CheckpointManager(Checkpoint(p=position), tmp_path, max_to_keep=None)
    assert recovered.checkpoints == manager.checkpoints
    assert recovered.restore_or_initialize() == str(tmp_path / "ckpt-4") and position.value == 4
    assert recovered.save().endswith("ckpt-5")
    assert recovered.save(checkpoint_number=10).endswith("ckpt-10")
    assert [os.path.basename(p) for p in recovered.checkpoints] == ["ckpt-3", "ckpt-4", "ckpt-5", "ckpt-10"]
    assert latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-10")


def test_manager_numbers_by_step_counter_and_validates(tmp_path):
    step = torch.tensor(40)
    manager = CheckpointManager(Checkpoint(step=step), tmp_path, step_counter=step)
    assert manager.save().endswith("ckpt-40")
    with pytest.raises(ValueError, match="max_to_keep=0"):
        CheckpointManager(Checkpoint(step=step), tmp_path, max_to_keep=0)
    with pytest.raises(ValueError, match="checkpoint_number"):
        manager.save(checkpoint_number=-1)


def test_latest_checkpoint_ignores_partial_directories(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "absent") is None
    Checkpoint(p=Position(1)).save(tmp_path / "ckpt-1")
    Checkpoint(p=Position(2)).save(tmp_path / "ckpt-2.tmp")  # a complete-looking leftover tmp
    no_metadata = Checkpoint(p=Position(3)).save(tmp_path / "ckpt-3")
    os.remove(os.path.join(no_metadata, ".metadata"))
    (tmp_path / "ckpt-4").mkdir()
    assert latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-1")
    assert latest_checkpoint(tmp_path, "ckpt") == str(tmp_path / "ckpt-1")
    assert latest_checkpoint(tmp_path, "other") is None
    assert CheckpointManager(Checkpoint(p=Position()), tmp_path).checkpoints == [str(tmp_path / "ckpt-1")]


def _failing_write_data(original):
    def write_data(self, plan, planner):
        original(self, plan, planner).wait()  # some shard files are on disk...
        raise OSError("disk full (simulated)")  # ...then the writer dies

    return write_data


@pytest.mark.parametrize("async_save", [False, True])
def test_failed_save_keeps_previous_checkpoint_latest(tmp_path, monkeypatch, async_save):
    from torch.distributed.checkpoint import FileSystemWriter

    position = Position(1)
    manager = CheckpointManager(Checkpoint(p=position, w=torch.ones(2)), tmp_path)
    first = manager.save()
    position.value = 2
    monkeypatch.setattr(FileSystemWriter, "write_data", _failing_write_data(FileSystemWriter.write_data))
    with pytest.raises(Exception, match="disk full"):
        if async_save:
            manager.save(async_save=True).result(timeout=60)
        else:
            manager.save()
    monkeypatch.undo()
    assert _dir_names(tmp_path) == ["checkpoint", "ckpt-1"]
    assert latest_checkpoint(tmp_path) == first and manager.checkpoints == [first]
    manager.restore_or_initialize()
    assert position.value == 1


def _crash_while_publishing(directory: str) -> None:
    import meshfit.train._storage as storage

    position = Position(1)
    manager = CheckpointManager(Checkpoint(p=position, w=torch.ones(2)), directory)
    manager.save()
    position.value = 2
    storage.publish_directory = lambda tmp, final: os._exit(17)  # killed between write and rename
    manager.save()


def test_process_killed_mid_save_leaves_previous_checkpoint_latest(tmp_path):
    assert exit_code_of(_crash_while_publishing, str(tmp_path), timeout=90) == 17
    assert _dir_names(tmp_path) == ["checkpoint", "ckpt-1", "ckpt-2.tmp"]
    assert latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-1")
    position = Position()
    manager = CheckpointManager(Checkpoint(p=position, w=torch.zeros(2)), tmp_path)
    assert manager.restore_or_initialize() == str(tmp_path / "ckpt-1") and position.value == 1
    assert manager.save().endswith("ckpt-2")  # the leftover tmp is cleared and the number reused
    assert _dir_names(tmp_path) == ["checkpoint", "ckpt-1", "ckpt-2"]


def test_async_save_round_trip(tmp_path):
    model, optimizer = _model_and_optimizer("adam")
    _train_step(model, optimizer, 0)
    manager = CheckpointManager(Checkpoint(model=model, optimizer=optimizer), tmp_path)
    future = manager.save(async_save=True)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _train_step(model, optimizer, 1)  # training goes on: the staged copy is what gets written
    path = future.result(timeout=60)
    assert future.done() and manager.latest_checkpoint == path
    Checkpoint(model=model, optimizer=optimizer).restore(path)
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key])


def _two_rank_job(rank: int, world_size: int, directory: str) -> dict:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from meshfit.train._storage import SafeFileSystemReader

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)  # identical on every rank
    position = Position(10 * rank + 1)  # different per rank: python state
    noise = torch.full((3,), float(rank))  # different per rank: a tensor
    manager = CheckpointManager(Checkpoint(model=model, position=PerRank(position), noise=PerRank(noise)),
                                directory, max_to_keep=1)
    first = manager.save()
    expected_weight = model.weight.detach().clone()
    position.value, _ = -1, noise.fill_(-1)
    with torch.no_grad():
        model.weight.zero_()
    manager.restore_or_initialize()
    restored = {"position": position.value, "noise": noise.tolist(),
                "weight_ok": torch.equal(model.weight, expected_weight)}

    position.value += 100
    future = manager.save(async_save=True)
    total = torch.ones(1)
    dist.all_reduce(total)  # training collectives go on while the background save runs
    second = future.result(timeout=60)
    metadata = SafeFileSystemReader(second).read_metadata()
    writers = [info.relative_path for index, info in metadata.storage_data.items() if index.fqn == "model/weight"]
    tensor_keys = sorted(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata))
    return {"restored": restored, "first": first, "second": second, "kept": manager.checkpoints,
            "total": total.item(), "weight_writers": writers, "tensor_keys": tensor_keys}


def test_two_rank_save_restore_per_rank_state_and_restore_on_one_process(tmp_path):
    results = run_distributed(_two_rank_job, world_size=2, args=(str(tmp_path),), timeout=150)
    for rank, result in enumerate(results):
        assert result["restored"] == {"position": 10 * rank + 1, "noise": [float(rank)] * 3, "weight_ok": True}
        assert result["total"] == 2.0
    second = results[0]["second"]
    assert results[1]["second"] == second and results[1]["kept"] == results[0]["kept"] == [second]
    assert _dir_names(tmp_path) == ["checkpoint", "ckpt-2"]  # max_to_keep=1 pruned ckpt-1
    assert len(results[0]["weight_writers"]) == 1  # the replicated weight is written once
    assert results[0]["tensor_keys"] == ["model/bias", "model/weight", "noise/rank0", "noise/rank1"]

    # One process restores the 2-rank checkpoint and gets rank 0's per-rank state.
    model, position, noise = torch.nn.Linear(3, 2), Position(), torch.zeros(3)
    Checkpoint(model=model, position=PerRank(position), noise=PerRank(noise)).restore(second)
    assert position.value == 101 and noise.tolist() == [0.0, 0.0, 0.0]
    torch.manual_seed(0)
    assert torch.equal(model.weight, torch.nn.Linear(3, 2).weight)


def _save_to_different_paths(rank: int, world: int, root: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    # Sharded state has no whole copy on any rank (replicated state may go to per-rank paths:
    # tests/test_own_copies.py, seed 000's write_filepath dance).
    mesh = init_device_mesh("cpu", (world,))
    ckpt = Checkpoint(table=distribute_tensor(torch.arange(4.0), mesh, [Shard(0)]))
    with pytest.raises(ValueError, match="same path") as info:
        ckpt.save(os.path.join(root, f"worker{rank}", "ckpt-1"))
    return str(info.value)


def test_ranks_saving_sharded_state_to_different_paths_is_an_error(tmp_path):
    messages = run_distributed(_save_to_different_paths, world_size=2, args=(str(tmp_path),), timeout=240)
    assert all("rank 0:" in m and "rank 1:" in m for m in messages)
    assert all("write_filepath" in m for m in messages)  # says what to change in the tutorial's code
    assert latest_checkpoint(str(tmp_path / "worker0")) is None


def test_a_bit_flip_in_a_data_file_is_an_error_naming_the_file(tmp_path):
    from meshfit._storage._checksum import ChecksumError

    path = Checkpoint(w=torch.arange(256.0)).save(tmp_path / "ckpt-1")
    data = os.path.join(path, "__0_0.distcp")
    flip_bits(data)
    with pytest.raises(ChecksumError, match="__0_0.distcp"):
        Checkpoint(w=torch.zeros(256)).restore(path)
    with pytest.raises(ChecksumError, match="__0_0.distcp"):
        load_checkpoint(path)


def test_restore_none_is_a_no_op_and_bad_paths_are_refused(tmp_path):
    step = torch.tensor(3)
    Checkpoint(step=step).restore(latest_checkpoint(tmp_path))  # TF's first-run idiom on an empty folder
    assert int(step) == 3
    existing = tmp_path / "a_file"
    existing.write_text("mine")
    with pytest.raises(FileExistsError, match="a_file"):
        Checkpoint(step=step).save(existing)
    assert existing.read_text() == "mine"
    with pytest.raises(TypeError, match="Invalid `path`"):
        Checkpoint(step=step).save(5)


def test_load_checkpoint_reads_tensors_by_name(tmp_path):
    model, optimizer = _model_and_optimizer("adam")
    _train_step(model, optimizer, 0)
    path = Checkpoint(model=model, optimizer=optimizer, rng=PerRank(torch.tensor([4, 5]))).save(tmp_path / "c-1")
    reader = load_checkpoint(path)
    shapes = reader.get_variable_to_shape_map()
    assert shapes["model/0.weight"] == [4, 3] and shapes["rng/rank0"] == [2]
    assert "optimizer/state/0/exp_avg" in shapes and reader.has_tensor("model/2.bias")
    assert torch.equal(reader.get_tensor("model/0.weight"), model[0].weight.detach())
    assert reader.get_variable_to_dtype_map()["rng/rank0"] == torch.int64
    with pytest.raises(KeyError, match="model/0.weight"):
        reader.get_tensor("nope")


class _Mean:
    """A metric-like accumulator whose value differs per rank."""

    def __init__(self, total: float) -> None:
        self.total = torch.tensor(total)

    def state_dict(self) -> dict:
        return {"total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.total.copy_(state["total"])


def _differing_plain_tensor(rank: int, world: int, root: str) -> dict:
    mean = _Mean(10.0 * (rank + 1))  # 10 on rank 0, 20 on rank 1
    with pytest.raises(ValueError, match=r"'mean'.*mean/total.*PerRank") as refused:
        Checkpoint(mean=mean).save(os.path.join(root, "shared"))
    Checkpoint(mean=PerRank(mean)).save(os.path.join(root, "per_rank"))
    mean.total.zero_()
    Checkpoint(mean=PerRank(mean)).restore(os.path.join(root, "per_rank"))
    return {"message": str(refused.value), "restored": float(mean.total)}


def test_a_tensor_that_differs_between_ranks_is_never_silently_dropped(tmp_path):
    results = run_distributed(_differing_plain_tensor, world_size=2, args=(str(tmp_path),), timeout=150)
    assert [r["restored"] for r in results] == [10.0, 20.0]  # each rank's own value came back
    assert all("rank 0:" in r["message"] and "rank 1:" in r["message"] for r in results)
    assert latest_checkpoint(tmp_path) == str(tmp_path / "per_rank")  # the refused save left nothing


def _save_on_a_full_disk(rank: int, world: int, directory: str) -> str:
    manager = CheckpointManager(Checkpoint(w=torch.zeros(200_000)), directory)  # 0.8 MB > the disk
    with pytest.raises(RuntimeError) as caught:
        manager.save()
    return str(caught.value)


def test_a_full_disk_reads_no_space_left_with_the_path_on_every_rank(tmp_path):
    from _disk import small_disk

    with small_disk(tmp_path / "disk") as disk:
        messages = run_distributed(_save_on_a_full_disk, world_size=2, args=(str(disk / "backup"),), timeout=150)
        assert os.listdir(disk / "backup") == []  # the partial save was removed
    for message in messages:
        assert "No space left on device" in message and str(disk / "backup" / "ckpt-1.tmp") in message, message
        assert "enforce fail" not in message


def test_async_saves_reuse_one_writer_thread_and_write_each_snapshot(tmp_path):
    import threading

    weight = torch.arange(6.0)
    manager = CheckpointManager(Checkpoint(w=weight), tmp_path, max_to_keep=5)
    snapshots, writers = [], []
    for _ in range(4):
        future = manager.save(async_save=True)
        snapshots.append(weight.clone())
        weight.add_(1.0)  # mutated right after the save returns: the write must not see it
        future.result(timeout=60)
        writers.append([t for t in threading.enumerate() if t.name.startswith("meshfit-checkpoint")])
    # one long-lived writer, not a thread per save: the same live thread after every save
    assert all(len(found) == 1 for found in writers) and len({found[0] for found in writers}) == 1
    for path, snapshot in zip(manager.checkpoints, snapshots, strict=True):
        restored = torch.zeros(6)
        Checkpoint(w=restored).restore(path)
        assert torch.equal(restored, snapshot)


def test_async_saves_without_dcps_stager_stage_plain_copies(tmp_path, monkeypatch):
    # A torch without DCP's DefaultStager: staging falls back to detached clones, still a snapshot.
    from meshfit.train import _background

    monkeypatch.setattr(_background, "_new_stager", lambda: False)
    weight = torch.arange(6.0)
    checkpoint = Checkpoint(w=weight)
    staged = checkpoint._staging.stage({"w": weight})
    assert torch.equal(staged["w"], weight) and staged["w"].data_ptr() != weight.data_ptr()
    future = checkpoint.save(tmp_path / "ckpt", async_save=True)
    weight.add_(1.0)  # the save holds its own copy
    restored = torch.zeros(6)
    Checkpoint(w=restored).restore(future.result(timeout=60))
    assert torch.equal(restored, torch.arange(6.0))


def test_async_saves_copy_into_the_same_staging_buffers_every_time(tmp_path):
    # The staging cache outlives a save: the second save copies into the first save's buffers (a
    # DCP whose stager dropped its cache after each stage failed on the second save).
    weight = torch.arange(6.0)
    checkpoint = Checkpoint(w=weight)
    first = checkpoint._staging.stage({"w": weight})["w"]
    weight.add_(1.0)
    second = checkpoint._staging.stage({"w": weight})["w"]
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, weight)
    assert second.data_ptr() != weight.data_ptr()
    for _ in range(3):
        checkpoint.save(tmp_path / f"ckpt-{int(weight[0])}", async_save=True).result(timeout=60)
        weight.add_(1.0)
    restored = torch.zeros(6)
    Checkpoint(w=restored).restore(tmp_path / "ckpt-3")
    assert torch.equal(restored, torch.arange(6.0) + 3)
