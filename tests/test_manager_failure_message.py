"""A peer dies in a custom loop that saves with a CheckpointManager (no BackupAndRestore): the survivor's
message names the manager's folder, its latest checkpoint and both workers' steps.

Two real worker processes on localhost (gloo); rank 1 kills itself (SIGKILL) before step 22, after several
heartbeat intervals (0.8 s) of steps, so that it reported a step even on a loaded machine.
"""

from __future__ import annotations

import os
import re

from _procs import child_env, finish_survivor, free_ports, start, tf_config

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "watched_loop.py")


def test_a_dead_peer_message_names_the_checkpoint_managers_folder_latest_checkpoint_and_steps(tmp_path):
    ports = free_ports(2)
    out, directory = str(tmp_path / "out"), str(tmp_path / "ckpt")
    args = [SCRIPT, "--kill-rank", "1", "--at", "22", "--sleep", "0.1", "--heartbeat", "4",
            "--manager-dir", directory, "--out", out]
    procs = [start(args, child_env(TF_CONFIG=tf_config(ports, rank))) for rank in (0, 1)]
    code, output = finish_survivor(procs[0], procs[1], timeout=120)
    assert code != 0, output
    # Saved every 5 steps from step 1 (1, 6, ..., 21): step 21 is the last one both workers completed.
    latest = os.path.join(directory, "ckpt-21")
    assert (f"This job's CheckpointManager writes to {directory!r} and its latest checkpoint is {latest!r}"
            in output), output
    assert "No backup was configured" not in output, output
    reported = re.search(r"its last reported step: (\d+); this worker, [^,]+, is at step 21\)", output)
    assert reported is not None and 0 <= int(reported[1]) <= 21, output
