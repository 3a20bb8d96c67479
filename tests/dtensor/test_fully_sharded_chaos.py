"""Fully sharded data parallel under ``meshfit launch --max-restarts`` (issue 21): a worker killed with
SIGKILL at a random step (a seeded choice) resumes from the sharded backup bitwise equal to an
uninterrupted run on the same 2 processes (the seed's Dense model with dropout, Adam, 16 steps)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from _procs import child_env, finish, start
from _script_outputs import assert_ranks_saved, read_weights

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "dtensor_keras.py")
STEPS = 16  # 256 examples, global batch 32, 2 epochs


def _run(out: str, *extra: str, restarts: int, preload: bool = False) -> str:
    proc = start(["-m", "meshfit._cli", "launch", "--workers", "2", "--max-restarts", str(restarts),
                  *(["--preload"] if preload else []), SCRIPT,
                  "--out", out, "--mesh", "batch=2", "--fully-sharded", *extra], child_env())
    code, output = finish(proc, timeout=400)
    assert code == 0, output
    return output


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[np.ndarray]:
    out = str(tmp_path_factory.mktemp("fsdp-reference"))
    _run(out, "--backup-dir", os.path.join(out, "backup"), "--save-freq", "5", restarts=0)
    assert "fully sharded" in open(os.path.join(out, "layouts-0.txt")).read()  # the FSDP path ran
    reference = read_weights(out, 0)
    assert [w.shape for w in reference] == [(16, 64), (16,), (10, 16), (10,)]  # gathered full arrays
    assert_ranks_saved(out, [1], reference)
    return reference


def test_sigkill_a_fully_sharded_worker_at_a_random_step_resumes_bitwise(tmp_path, uninterrupted):
    chance = random.Random(21)
    rank, step = chance.choice([0, 1]), chance.randrange(7, STEPS + 1)  # after the step-5 backup
    out = str(tmp_path / "out")
    output = _run(out, "--backup-dir", str(tmp_path / "backup"), "--save-freq", "5", "--kill-rank", str(rank),
                  "--kill-at", str(step), restarts=2, preload=True)  # forks of one preloaded process
    assert "restarting the group" in output and "resuming from" in output, (rank, step, output)
    assert_ranks_saved(out, (0, 1), uninterrupted)  # bitwise equal to the run that was never killed
