"""CheckpointManager's TF arguments beyond the ported TF tests: checkpoint numbers of every integer kind, the
folder's newest checkpoint of another name, argument errors, and what a peer failure's message names."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import meshfit as mf
from meshfit.distribute import FailureState

Checkpoint, CheckpointManager = mf.train.Checkpoint, mf.train.CheckpointManager


@pytest.mark.parametrize("number", [np.int64(7), np.int32(7), np.array(7), torch.tensor(7), torch.tensor([7]),
                                    torch.tensor(7, dtype=torch.int32)])
def test_checkpoint_number_may_be_a_numpy_integer_or_an_integer_tensor(tmp_path, number):
    manager = CheckpointManager(Checkpoint(), tmp_path)
    assert manager.save(checkpoint_number=number) == str(tmp_path / "ckpt-7")


@pytest.mark.parametrize("number", [torch.tensor(7.0), np.float64(7.0), 7.0, True, torch.tensor([1, 2]), -1, "7"])
def test_a_checkpoint_number_that_is_not_a_non_negative_integer_is_refused(tmp_path, number):
    manager = CheckpointManager(Checkpoint(), tmp_path)
    with pytest.raises(ValueError, match=r"Invalid `checkpoint_number`: expected a non-negative int.*received "
                                         r"checkpoint_number="):
        manager.save(checkpoint_number=number)
    assert manager.checkpoints == []


def test_restore_or_initialize_restores_a_checkpoint_saved_under_another_name(tmp_path):
    weight = torch.tensor([1.0, 2.0])
    Checkpoint(w=weight).save(tmp_path / "model-3")
    restored = torch.zeros(2)
    manager = CheckpointManager(Checkpoint(w=restored), tmp_path, init_fn=lambda: pytest.fail("nothing to init"))
    assert manager.latest_checkpoint == mf.train.latest_checkpoint(tmp_path) == str(tmp_path / "model-3")
    assert manager.checkpoints == []  # not one of its own: never pruned by it
    assert manager.restore_or_initialize() == str(tmp_path / "model-3")
    assert torch.equal(restored, weight)


def test_interval_counts_from_the_restored_step(tmp_path):
    step = torch.tensor(10)
    manager = CheckpointManager(Checkpoint(step=step), tmp_path, step_counter=step, checkpoint_interval=5)
    assert manager.save().endswith("ckpt-10")
    step.fill_(3)
    assert manager.restore_or_initialize().endswith("ckpt-10") and int(step) == 10
    step.add_(4)
    assert manager.save() is None  # 14 < 10 + 5
    step.add_(1)
    assert manager.save().endswith("ckpt-15")


def test_a_callable_step_counter_is_read_at_each_save(tmp_path):
    steps = iter([0, 1, 4])
    manager = CheckpointManager(Checkpoint(), tmp_path, step_counter=lambda: next(steps), checkpoint_interval=3)
    assert manager.save().endswith("ckpt-0")
    assert manager.save() is None
    assert manager.save().endswith("ckpt-4")


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"checkpoint_interval": 2}, ValueError, r"`step_counter` should be passed if `checkpoint_interval` is not None"),
    ({"checkpoint_interval": 0, "step_counter": 0}, ValueError, r"checkpoint_interval=0"),
    ({"keep_checkpoint_every_n_hours": -1.0}, ValueError, r"keep_checkpoint_every_n_hours=-1.0"),
    ({"init_fn": "restore"}, TypeError, r"init_fn='restore'"),
    ({"last_checkpoint_step": 1.5}, ValueError, r"last_checkpoint_step=1.5"),
])
def test_bad_arguments_are_named(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        CheckpointManager(Checkpoint(), tmp_path, **kwargs)


def test_save_counter_counts_saves_and_comes_back_on_restore(tmp_path):
    checkpoint = Checkpoint(w=torch.zeros(1))
    manager = CheckpointManager(checkpoint, tmp_path)
    first = manager.save()
    manager.save()
    assert checkpoint.save_counter == 2
    checkpoint.restore(first)
    assert checkpoint.save_counter == 1


def test_a_failure_message_names_the_managers_folder_latest_checkpoint_and_step(tmp_path):
    state = FailureState()
    assert state.where_to_resume().startswith("No backup was configured") and state.current_step() is None
    step = torch.tensor(0)
    checkpoint = Checkpoint(step=step)
    manager = CheckpointManager(checkpoint, tmp_path, step_counter=step, checkpoint_interval=2)
    state.register_checkpoints(manager)
    assert f"writes to {str(tmp_path)!r} and it has saved no checkpoint yet" in state.where_to_resume()
    step.fill_(4)
    path = manager.save()
    step.fill_(5)
    assert state.current_step() == 5  # read live from the step tensor
    message = state.where_to_resume()
    assert f"its latest checkpoint is {path!r}" in message and "restore_or_initialize()" in message
    state.step = 9  # the training loop's own count wins
    assert state.current_step() == 9
    state.backup_dir = str(tmp_path / "backup")  # a BackupAndRestore wins
    assert "The last backup is in" in state.where_to_resume()
    del manager, checkpoint
    state.step, state.backup_dir = None, None
    assert state.where_to_resume().startswith("No backup was configured")  # held weakly: a gone manager is not named
    assert os.path.isdir(path)
