"""The seed's flow as real scripts: a plain-script (2, 2) mesh that starts its own processes, and a
worker killed with SIGKILL under ``meshfit launch --max-restarts`` ending bitwise equal."""

from __future__ import annotations

import os

import pytest
from _procs import child_env, finish, start
from _script_outputs import assert_ranks_saved, read_weights

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "dtensor_keras.py")


@pytest.fixture(scope="module")
def plain_script_run(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("plain"))
    code, output = finish(start([SCRIPT, "--out", out, "--devices", "4"], child_env()), timeout=400)
    assert code == 0, output
    return out


def test_plain_script_starts_four_processes_for_a_2x2_mesh(plain_script_run):
    out = plain_script_run
    layouts = [open(os.path.join(out, f"layouts-{rank}.txt")).read() for rank in range(4)]
    assert len(set(layouts)) == 1  # the same layouts and the same loss on every process
    assert "feature.weight DTensor sharding_specs:model,unsharded, mesh:|batch=2,model=2|cpu" in layouts[0]
    assert "feature_2.bias DTensor sharding_specs:model, mesh:|batch=2,model=2|cpu" in layouts[0]
    reference = read_weights(out, 0)
    assert [w.shape for w in reference] == [(16, 64), (16,), (10, 16), (10,)]  # full arrays
    assert_ranks_saved(out, range(1, 4), reference)


def test_sigkill_on_a_2x2_mesh_under_launch_resumes_bitwise(plain_script_run, tmp_path):
    out = str(tmp_path / "out")
    # forks of one preloaded process; the reference ran as a plain script (new interpreters)
    proc = start(["-m", "meshfit._cli", "launch", "--workers", "4", "--max-restarts", "2", "--preload", SCRIPT,
                  "--out", out, "--backup-dir", str(tmp_path / "backup"), "--save-freq", "5", "--kill-rank", "1",
                  "--kill-at", "9"], child_env())
    code, output = finish(proc, timeout=500)
    assert code == 0, output
    assert "restarting the group" in output and "resuming from" in output, output
    assert_ranks_saved(out, range(4), read_weights(plain_script_run, 0))  # bitwise equal to the never-killed run
