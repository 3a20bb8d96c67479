"""A complete checkpoint's identity never changes, and a manager restores past a corrupt one (issue 14, items 7 and 13).

Item 7 of the reliability battery: an overwrite save (``manager.save(checkpoint_number=1)`` again)
interrupted by kill -9 left ``ckpt-1`` holding step 4 while the last save acknowledged as
``ckpt-1`` was step 3. The replacing rename is the commit, so a kill after it and before ``save``
returns makes the name hold a step nobody was told about. The manager therefore never reuses the
number of a complete checkpoint: ``ckpt-N`` always holds what the save numbered ``N`` wrote.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import textwrap
import time

import pytest
import torch

from meshfit._storage._atomic import _WRITER_ATTRIBUTE
from meshfit.train import Checkpoint, CheckpointManager
from tests import _procs
from tests._tamper import flip_bits
from tests._trackables import Position


def test_the_manager_refuses_to_reuse_the_number_of_a_complete_checkpoint(tmp_path):
    step = Position(3)
    manager = CheckpointManager(Checkpoint(s=step, w=torch.ones(2)), tmp_path)
    manager.save(checkpoint_number=1)
    step.value = 4
    with pytest.raises(FileExistsError, match=r"ckpt-1.*already a complete checkpoint.*save\(\) with no number uses 2"):
        manager.save(checkpoint_number=1)
    assert manager.save().endswith("ckpt-2")  # the next free number
    step.value = 0
    Checkpoint(s=step, w=torch.zeros(2)).restore(tmp_path / "ckpt-1")
    assert step.value == 3  # ckpt-1 still holds what was saved as ckpt-1


def test_a_step_counter_that_did_not_move_does_not_overwrite_its_checkpoint(tmp_path):
    counter = torch.tensor(7)
    manager = CheckpointManager(Checkpoint(c=counter), tmp_path, step_counter=counter)
    manager.save()
    with pytest.raises(FileExistsError, match=r"`step_counter`.*ckpt-7"):
        manager.save()
    # a new manager over the same folder (a restarted job) knows the number too
    with pytest.raises(FileExistsError, match="ckpt-7"):
        CheckpointManager(Checkpoint(c=counter), tmp_path, step_counter=counter).save()


def test_restore_or_initialize_skips_a_corrupt_latest_checkpoint_and_names_it(tmp_path):
    step = Position()
    weights = torch.zeros(64)
    manager = CheckpointManager(Checkpoint(s=step, w=weights), tmp_path)
    for value in (1, 2, 3):
        step.value = value
        weights.fill_(float(value))
        manager.save()
    flip_bits(os.path.join(tmp_path, "ckpt-3", "__0_0.distcp"))
    step.value, weights = 0, torch.zeros(64)
    restarted = CheckpointManager(Checkpoint(s=step, w=weights), tmp_path)
    with pytest.warns(RuntimeWarning, match=r"Skipping the corrupt backup .*ckpt-3.*__0_0\.distcp"):
        assert restarted.restore_or_initialize() == str(tmp_path / "ckpt-2")
    assert step.value == 2 and torch.equal(weights, torch.full((64,), 2.0))


def test_restore_or_initialize_raises_when_no_checkpoint_verifies(tmp_path):
    from meshfit._storage._checksum import CorruptFileError

    manager = CheckpointManager(Checkpoint(w=torch.ones(64)), tmp_path)
    manager.save()
    flip_bits(os.path.join(tmp_path, "ckpt-1", "__0_0.distcp"))
    with pytest.warns(RuntimeWarning, match="ckpt-1"), pytest.raises(CorruptFileError, match="ckpt-1"):
        CheckpointManager(Checkpoint(w=torch.zeros(64)), tmp_path).restore_or_initialize()


_SAVER = textwrap.dedent("""
    import sys, torch
    from meshfit.train import Checkpoint, CheckpointManager

    class Step:
        value = 0
        def state_dict(self): return {"value": self.value}
        def load_state_dict(self, state): self.value = state["value"]

    directory, async_save = sys.argv[1], sys.argv[2] == "async"
    step, weights = Step(), torch.zeros(20_000)
    manager = CheckpointManager(Checkpoint(s=step, w=weights), directory, max_to_keep=3)
    for value in range(1, 10_000):
        step.value = value
        weights.fill_(float(value))
        result = manager.save(checkpoint_number=value, async_save=async_save)
        if async_save:
            result.result()
        print("saved", value, flush=True)
""")


def _kill_during_saves(tmp_path, mode: str, seed: int) -> None:
    script = tmp_path / "saver.py"
    script.write_text(_SAVER)
    directory = tmp_path / "ckpts"
    proc = _procs.start([str(script), str(directory), mode], env=_procs.child_env())
    acknowledged = 0
    try:
        deadline = time.monotonic() + 60
        while acknowledged < 3 and time.monotonic() < deadline:  # a few saves in, then a random moment
            line = proc.stdout.readline()
            if line.startswith("saved"):
                acknowledged = int(line.split()[1])
        assert acknowledged >= 3, "the saver never got going"
        time.sleep(random.Random(seed).uniform(0.0, 0.3))
        os.killpg(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate(timeout=30)
    finally:
        _procs.kill_group(proc)
    # whole lines only: unbuffered, a print cut by the kill may have written "saved" without its number
    acknowledged = max([acknowledged] + [int(m) for m in re.findall(r"^saved (\d+)\n", rest, re.M)])

    step, weights = Position(), torch.zeros(20_000)
    manager = CheckpointManager(Checkpoint(s=step, w=weights), directory, max_to_keep=3)
    numbers = [int(p.rsplit("-", 1)[1]) for p in manager.checkpoints]
    assert numbers and numbers[-1] in (acknowledged, acknowledged + 1), (numbers, acknowledged)
    for path, number in zip(manager.checkpoints, numbers, strict=True):  # each name holds its own save
        Checkpoint(s=step, w=weights).restore(path)
        assert step.value == number and torch.equal(weights, torch.full((20_000,), float(number))), path
    assert manager.restore_or_initialize() == manager.checkpoints[-1]
    manager.save()  # the next save cleans what the dead writer left
    leftovers = [n for n in os.listdir(directory) if ".tmp" in n or ".old" in n or ".deleting" in n]
    assert leftovers == [], (leftovers, _writers(directory, leftovers), f"the saver was pid {proc.pid}, "
                             f"this process is pid {os.getpid()}")


def _writers(directory, names: list[str]) -> dict[str, str]:
    """Each leftover's recorded writer and whether that pid runs now: what the clean-up decided on."""
    found = {}
    for name in names:
        try:
            owner = os.getxattr(os.path.join(directory, name), _WRITER_ATTRIBUTE).decode()
            found[name] = f"{owner}, pid alive now: {_procs.pid_alive(int(json.loads(owner)['pid']))}"
        except (OSError, ValueError, KeyError) as error:
            found[name] = f"no writer recorded ({error})"
    return found


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_during_saves_never_rebinds_a_checkpoint_name(tmp_path, mode):
    _kill_during_saves(tmp_path, mode, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(3))
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_during_saves_chaos_trials(tmp_path, mode, trial):
    _kill_during_saves(tmp_path, mode, seed=100 + trial)


def test_a_new_manager_waits_for_an_async_save_in_flight(tmp_path):
    """An interrupted fit leaves its async backup in flight; the next manager must count it (fit's resume)."""
    first = CheckpointManager(Checkpoint(w=torch.ones(20_000_000)), tmp_path)  # 80 MB: still writing below
    first.save(async_save=True)
    second = CheckpointManager(Checkpoint(w=torch.zeros(20_000_000)), tmp_path)
    assert second.checkpoints == [str(tmp_path / "ckpt-1")]
    assert second.save().endswith("ckpt-2")
