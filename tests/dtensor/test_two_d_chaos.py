"""2-D parallelism under ``meshfit launch --max-restarts``: a worker of a (2, 2) mesh killed with SIGKILL at
a random step (a seeded choice) resumes from the sharded backup bitwise equal to an uninterrupted (2, 2)
run (the small transformer LM, AdamW, 2 epochs of 20 steps, step backups every 5)."""

from __future__ import annotations

import os
import random

import pytest
from _procs import child_env, finish, start
from _script_outputs import assert_ranks_saved, read_weights

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "two_d_lm.py")
STEPS = 40

# 4 processes a run, two runs, on a shared 2-core machine
pytestmark = [pytest.mark.timeout(1500), pytest.mark.crowded]


def _run(out: str, *extra: str, restarts: int) -> str:
    # forked from one preloaded process: 4 new interpreters would add 15 CPU-s to each run (the 2-worker
    # chaos tests compare ranks started both ways)
    proc = start(["-m", "meshfit._cli", "launch", "--workers", "4", "--max-restarts", str(restarts), "--preload",
                  SCRIPT, "--out", out, *extra], child_env())
    code, output = finish(proc, timeout=700)
    assert code == 0, output
    return output


def test_sigkill_a_two_by_two_worker_at_a_random_step_resumes_bitwise(tmp_path):
    reference = str(tmp_path / "reference")
    _run(reference, restarts=0)  # without BackupAndRestore: the backups may not change a bit of training
    uninterrupted = read_weights(reference, 0)
    chance = random.Random(22)
    rank, step = chance.randrange(4), chance.randrange(7, STEPS + 1)  # after the step-5 backup
    out = str(tmp_path / "out")
    output = _run(out, "--backup-dir", os.path.join(out, "backup"), "--kill-rank", str(rank), "--kill-at", str(step),
                  restarts=2)
    assert "restarting the group" in output and "resuming from" in output, (rank, step, output)
    assert_ranks_saved(out, range(4), uninterrupted)  # bitwise equal to the run that was never killed
