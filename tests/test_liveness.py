"""A killed peer is reported at once (its liveness connection closes), not after the heartbeat timeout."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from _procs import child_env, finish, free_ports, start, tf_config, wait_until

from meshfit.distribute._liveness._liveness import Liveness, invitation, read_invitation

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "train_digits.py")
SECRET = b"0123456789abcdef"


def _pair(world: int = 2):
    deaths: list[tuple[int, float]] = []
    chief = Liveness(0, world, SECRET, on_death=lambda r: deaths.append((r, time.monotonic())))
    port = chief.listen("127.0.0.1")
    return chief, port, deaths


def test_a_connection_closed_without_goodbye_is_a_death_at_once_and_the_others_are_told():
    chief, port, deaths = _pair(world=3)
    told: list[int] = []
    victim, other = Liveness(1, 3, SECRET), Liveness(2, 3, SECRET, on_death=told.append)
    victim.connect("127.0.0.1", port, timeout=5)
    other.connect("127.0.0.1", port, timeout=5)
    try:
        time.sleep(0.2)  # both said who they are
        closed = time.monotonic()
        victim.stop(goodbye=False)  # what the kernel does for a killed process
        assert wait_until(lambda: deaths and told == [1], 5.0, interval=0.01), (deaths, told)
        assert deaths[0][0] == 1 and deaths[0][1] - closed < 0.5
    finally:
        other.stop(goodbye=True)
        chief.stop(goodbye=True)


def test_a_goodbye_is_not_a_death_and_a_worker_sees_rank_0_die():
    chief, port, deaths = _pair()
    seen: list[int] = []
    worker = Liveness(1, 2, SECRET, on_death=seen.append)
    worker.connect("127.0.0.1", port, timeout=5)
    time.sleep(0.2)
    worker.stop(goodbye=True)
    time.sleep(0.3)
    assert deaths == []
    worker = Liveness(1, 2, SECRET, on_death=seen.append)
    worker.connect("127.0.0.1", port, timeout=5)
    time.sleep(0.2)
    chief.stop(goodbye=False)
    try:
        assert wait_until(lambda: seen == [0], 5.0, interval=0.01), seen
    finally:
        worker.stop(goodbye=False)


def test_a_stranger_cannot_pose_as_a_worker():
    chief, port, deaths = _pair()
    try:
        for hello in (b"\x00\x00\x00\x01" + b"x" * 20, b"junk"):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as stranger:
                stranger.sendall(hello)
                time.sleep(0.2)
        time.sleep(0.3)
        assert deaths == []  # its connection was never taken for worker 1's
    finally:
        chief.stop(goodbye=True)


def test_the_invitation_round_trips():
    assert read_invitation(invitation(SECRET, ("10.1.2.3", 40123))) == (SECRET, ("10.1.2.3", 40123))
    assert read_invitation(invitation(SECRET, None)) == (SECRET, None)


def _read_lines(proc, lines: list[tuple[float, str]]) -> threading.Thread:
    def read():
        for line in proc.stdout:
            lines.append((time.time(), line))
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("victim", [1, 0], ids=["worker", "chief"])
def test_a_killed_peer_is_reported_within_one_second(tmp_path, victim):
    """kill -9 of one of 2 workers mid-training; the survivor's message within 1 s, with a heartbeat
    timeout of 30 s (so the heartbeat cannot be what found it)."""
    ports = free_ports(2)
    out, backup = str(tmp_path / "out"), str(tmp_path / "backup")
    args = [SCRIPT, "--out", out, "--examples", "256", "--global-batch", "32", "--epochs", "50", "--sleep", "0.05",
            "--backup-dir", backup, "--save-freq", "4", "--kill-rank", str(victim), "--kill-at", "10",
            "--heartbeat", "30"]
    procs = [start(args, child_env(TF_CONFIG=tf_config(ports, rank))) for rank in (0, 1)]
    survivor = procs[1 - victim]
    lines: list[tuple[float, str]] = []
    reader = _read_lines(survivor, lines)
    try:
        assert survivor.wait(timeout=120) != 0
        reader.join(timeout=10)
    finally:
        for proc in procs:
            finish(proc, timeout=30)
    output = "".join(line for _, line in lines)
    said = [at for at, line in lines if f"Worker {victim} stopped" in line]
    assert said, output
    killed = float(open(os.path.join(out, "killed-at.txt")).read())
    assert "its process ended" in output, output  # found by its connection closing, not by silence
    # 1 s is the target; the measured figure is ~0.05-0.3 s. The test machine runs other jobs on 2
    # cores, so the survivor's Python may wait for a core: 1 s holds the target itself, no slack.
    print(f"kill -> message {said[0] - killed:.3f} s")
    assert said[0] - killed <= 1.0, (said[0] - killed, output)
