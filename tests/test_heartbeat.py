"""Liveness: a frozen or dead peer — the chief included — is named within 15 s, in fit and in custom
loops; a spoofed heartbeat cannot kill a healthy job; user errors are not delayed.

Real worker processes on localhost (gloo); SIGSTOP freezes a worker (alive, silent), SIGKILL kills it.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from datetime import timedelta

import pytest
from _multiproc import run_distributed
from _procs import child_env, finish, finish_survivor, free_ports, kill_group, start, tf_config
from torch import nn

import meshfit as mf
from meshfit.distribute import PEER_FAILURE_EXIT_CODE

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
FIT = os.path.join(SCRIPTS, "train_digits.py")
CUSTOM = os.path.join(SCRIPTS, "watched_loop.py")
FIT_ARGS = ["--examples", "256", "--global-batch", "32", "--epochs", "50", "--sleep", "0.05", "--heartbeat", "4"]


def _pair(args: list[str], tmp_path) -> tuple[list[subprocess.Popen], str]:
    ports = free_ports(2)
    out = str(tmp_path / "out")
    procs = [start([*args, "--out", out], child_env(TF_CONFIG=tf_config(ports, rank))) for rank in (0, 1)]
    return procs, out


def _survivor_detects(args: list[str], tmp_path, victim: int, event: str) -> tuple[float, str]:
    """Run 2 workers; rank ``victim`` freezes or dies; return (seconds to the survivor's exit, its output)."""
    procs, out = _pair(args, tmp_path)
    survivor = procs[1 - victim]
    try:
        code, output = finish(survivor, timeout=120)
        ended = time.time()
    finally:
        kill_group(procs[victim])  # SIGKILL also ends a stopped process
        finish(procs[victim], timeout=30)
    at = float(open(os.path.join(out, f"{event}-at.txt")).read())
    # the code that tells a launcher this worker followed a peer's failure (watchdog or uncaught error)
    assert code == PEER_FAILURE_EXIT_CODE, output
    return ended - at, output


def _check_named(seconds: float, output: str, victim: int, why: str = "dead, frozen or unreachable") -> None:
    assert seconds <= 15.0, (seconds, output)
    assert f"Worker {victim} stopped (worker {victim} at 127.0.0.1:" in output, output
    assert why in output, output


KILLED = "its process ended (killed or crashed)"  # found by its liveness connection closing, at once


def test_frozen_chief_is_named_within_15_s_in_fit(tmp_path):
    # Rank 0 hosts the rendezvous store: freezing it freezes the store too.
    seconds, output = _survivor_detects([FIT, *FIT_ARGS, "--backup-dir", str(tmp_path / "backup"),
                                         "--save-freq", "4", "--freeze-rank", "0", "--freeze-at", "6"],
                                        tmp_path, victim=0, event="frozen")
    _check_named(seconds, output, victim=0)
    silent = re.search(r"rendezvous store did not answer for ([0-9.]+) s", output)
    assert silent, output
    # Declared at the timeout (4 s), not at the end of whichever 2-s request was under way then (5.6 s).
    assert float(silent.group(1)) < 5.0, output
    assert str(tmp_path / "backup") in output, output  # says where the last backup is


@pytest.mark.slow
def test_frozen_worker_is_named_within_15_s_in_fit(tmp_path):
    seconds, output = _survivor_detects([FIT, *FIT_ARGS, "--freeze-rank", "1", "--freeze-at", "6"],
                                        tmp_path, victim=1, event="frozen")
    _check_named(seconds, output, victim=1)


def test_a_peer_killed_as_the_first_async_backup_forms_its_group_is_named(tmp_path):
    # Rank 1 dies after step 4's collectives; rank 0 goes on into the first async save, which creates
    # its process group: bounded by meshfit's timeout, and the watchdog is not blocked behind it.
    seconds, output = _survivor_detects([FIT, *FIT_ARGS, "--backup-dir", str(tmp_path / "backup"),
                                         "--save-freq", "4", "--async-save", "--kill-end-rank", "1",
                                         "--kill-end-at", "4"], tmp_path, victim=1, event="killed")
    _check_named(seconds, output, victim=1, why=KILLED)


def test_dead_peer_in_a_custom_loop_is_named(tmp_path):
    seconds, output = _survivor_detects([CUSTOM, "--kill-rank", "1"], tmp_path, victim=1, event="killed")
    _check_named(seconds, output, victim=1, why=KILLED)
    assert "PeerFailureError" in output, output  # raised from strategy.run / reduce, not a raw gloo error


def test_under_torchrun_variables_a_dead_peer_is_named_with_its_address(tmp_path):
    # torchrun's variables name rank 0's address only: the workers tell each other theirs at rendezvous.
    (port,) = free_ports(1)
    out = str(tmp_path / "out")
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [start([CUSTOM, "--kill-rank", "1", "--out", out], child_env(RANK=str(r), LOCAL_RANK=str(r), **env))
             for r in (0, 1)]
    code, output = finish_survivor(procs[0], procs[1], timeout=120)
    assert code != 0, output
    victim_pid = procs[1].pid
    assert re.search(rf"Worker 1 stopped \(worker 1 at 127\.0\.0\.1 \([^,]+, pid {victim_pid}\)\)", output), output


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1], ids=["chief", "worker"])
def test_frozen_peer_in_a_custom_loop_is_named(tmp_path, victim):
    seconds, output = _survivor_detects([CUSTOM, "--freeze-rank", str(victim)], tmp_path, victim=victim,
                                        event="frozen")
    _check_named(seconds, output, victim=victim)


_SPOOFER = r"""
import socket, sys, time, datetime, torch.distributed as dist
print("ready", flush=True)

def connect(seconds):
    return dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, False, datetime.timedelta(seconds=seconds))

# Connect as soon as the store listens (the store client's own retries back off for seconds at a time).
for _ in range(3000):
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1).close()
        break
    except OSError:
        time.sleep(0.01)
store = connect(30)
deadline = time.monotonic() + float(sys.argv[2])
writes = 0
stale = {}
while time.monotonic() < deadline:
    try:
        for key in store.list_keys():
            if "meshfit/hb" in key:  # any heartbeat key, under whatever prefix the store adds
                # replay the first value ever seen under each heartbeat key, again and again
                stale.setdefault(key, store.get(key))
                store.set(key, stale[key])
                writes += 1
        time.sleep(0.003)
    except Exception:  # the store is not up yet, or the job ended and took it along
        time.sleep(0.2)
        try:
            store = connect(3)
        except Exception:
            break
print("spoofed", writes, flush=True)
"""


@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_a_spoofed_heartbeat_cannot_kill_a_healthy_job(tmp_path, loop):
    ports = free_ports(2)
    out = str(tmp_path / "out")
    args = ([CUSTOM, "--out", out, "--steps", "150", "--heartbeat", "2"] if loop == "custom" else
            [FIT, "--out", out, "--examples", "256", "--global-batch", "32", "--epochs", "12", "--sleep", "0.02",
             "--heartbeat", "2"])
    script = tmp_path / "spoofer.py"
    script.write_text(_SPOOFER)
    spoofer = start([str(script), str(ports[0]), "25"], child_env())  # forked warm: torch already imported
    procs = []
    try:
        assert spoofer.stdout.readline().strip() == "ready"  # torch imported: it connects while the job runs
        procs = [start(args, child_env(TF_CONFIG=tf_config(ports, rank))) for rank in (0, 1)]
        results = [finish(p, timeout=180) for p in procs]
    finally:
        for p in procs:
            kill_group(p)
        spoof_code, spoof_out = finish(spoofer, timeout=60)
    for code, output in results:
        assert code == 0, output
    match = re.search(r"spoofed (\d+)", spoof_out)
    assert match and int(match.group(1)) > 100, spoof_out  # it did rewrite the keys while the job ran


def _worker_user_timeout_error(rank: int, world: int) -> float:
    strategy = mf.MultiWorkerMirroredStrategy()  # joins the test's group; heartbeat on (6 s)
    (x, y), _ = mf.datasets.load_digits()

    class Fails(mf.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                self.raised = time.monotonic()
                raise RuntimeError("reading shard 3 hit a timeout in my data service")

    with strategy.scope():
        model = mf.Model(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)))
        model.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    callback = Fails()
    with pytest.raises(RuntimeError, match="hit a timeout"):
        model.fit(x[:128], y[:128], batch_size=32, epochs=1, verbose=0, callbacks=[callback])
    return time.monotonic() - callback.raised


def test_a_user_error_mentioning_timeout_surfaces_in_under_a_second():
    delays = run_distributed(_worker_user_timeout_error, world_size=2, timeout=180)
    assert max(delays) < 1.0, delays


@pytest.mark.parametrize(("error", "expected"), [
    (RuntimeError("the data service timed out: timeout"), False),
    (RuntimeError("socket closed by peer in my code"), False),
    (RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                  "by peer [127.0.0.1]:5"), True),
    (RuntimeError("Got the following error when running the callback: RuntimeError: [/x/gloo/transport/tcp/"
                  "unbound_buffer.cc:78] Timed out waiting 30000ms for recv operation to complete"), True),
])
def test_communication_errors_are_classified_by_type_and_origin(error, expected):
    from meshfit.distribute._collective import is_communication_error

    assert is_communication_error(error) is expected


def test_dist_errors_are_communication_errors():
    import torch.distributed as dist

    from meshfit.distribute._collective import is_communication_error

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=1), wait_for_workers=False)
    with pytest.raises(dist.DistError) as caught:
        store.get("missing")
    assert is_communication_error(caught.value)


def test_watchdog_store_requests_are_bounded_even_when_the_server_is_frozen():
    """torch's store client blocks forever on a frozen server; the watchdog's connection does not."""
    from meshfit.distribute._liveness._bounded_store import BoundedStore

    release = threading.Event()

    class Frozen:
        def check(self, keys):
            release.wait(30)
            return True

    bounded = BoundedStore(lambda: Frozen(), 0.5)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        bounded.call(lambda store: store.check(["k"]))
    assert time.monotonic() - started < 2
    release.set()


class _MutableStore:
    """An in-process store whose writes can be cut off, as a frozen or cut-off worker's are."""

    def __init__(self, store) -> None:
        self.store, self.muted = store, False

    def set(self, key, value):
        if self.muted:
            raise RuntimeError("cut off")
        return self.store.set(key, value)

    def __getattr__(self, name):
        return getattr(self.store, name)


def _heartbeats(world_size: int, timeout: float):
    """Heartbeats of ranks sharing one in-process store (no process group: the watchdog alone)."""
    import torch.distributed as dist

    from meshfit.distribute._liveness._failure import FailureState
    from meshfit.distribute._liveness._heartbeat import Heartbeat

    shared = dist.HashStore()

    def start(rank: int, store=None):
        store = store or shared
        return Heartbeat(lambda: store, rank, world_size, timeout, FailureState(), b"k" * 16, interval=0.1)

    return shared, start


def _wait_for_failure(watcher, seconds: float) -> float:
    started = time.monotonic()
    while watcher.failure is None and time.monotonic() - started < seconds:
        time.sleep(0.02)
    return time.monotonic() - started


def test_a_peer_never_heard_from_gets_twice_the_timeout_one_that_fell_silent_the_timeout():
    """A starting worker's beat thread can wait seconds for the interpreter lock on a loaded host: its
    first beat gets twice the timeout. A peer that beat and then fell silent is named after the timeout."""
    timeout = 1.0
    _, start = _heartbeats(2, timeout)
    watcher = start(0)  # rank 1 never starts
    try:
        waited = _wait_for_failure(watcher, 10)
        assert watcher.failure is not None, "a peer that never beat was not named"
        assert 2 * timeout <= waited < 2 * timeout + 1.5, waited
        assert "Worker 1 stopped" in str(watcher.failure) and "since it joined" in str(watcher.failure)
    finally:
        watcher.stop()

    shared, start = _heartbeats(2, timeout)
    muted = _MutableStore(shared)
    watcher, peer = start(0), start(1, muted)
    try:
        time.sleep(0.5)
        assert watcher.failure is None
        muted.muted = True  # rank 1's beats stop without a goodbye
        waited = _wait_for_failure(watcher, 10)
        assert watcher.failure is not None, "a peer that fell silent was not named"
        assert timeout - 0.2 <= waited < timeout + 1.5, waited
        assert "Worker 1 stopped" in str(watcher.failure) and "since it joined" not in str(watcher.failure)
    finally:
        watcher.stop()
        peer.stop()


def test_a_peer_failure_names_both_workers_steps_or_says_there_was_none():
    """The message gives the dead peer's last reported step and this worker's; a worker that had not
    reported one (killed in its first steps, between two beats) is said to have reported none, not "?"."""
    import torch.distributed as dist

    from meshfit.distribute._liveness._failure import FailureState
    from meshfit.distribute._liveness._heartbeat import Heartbeat

    for watcher_step, peer_step, expected in (
            (None, None, "(it had reported no step; this worker, rank 0, has run no step)"),
            (7, 12, "(its last reported step: 12; this worker, rank 0, is at step 7)")):
        shared = dist.HashStore()
        states = [FailureState(step=watcher_step), FailureState(step=peer_step)]
        watcher, peer = (Heartbeat(lambda store=shared: store, rank, 2, 5.0, states[rank], b"k" * 16, interval=0.05)
                         for rank in (0, 1))
        try:
            time.sleep(0.5)  # several rounds: the watcher has read the peer's beats
            watcher.peer_ended(1)
            assert expected in str(watcher.failure), str(watcher.failure)
        finally:
            watcher.stop()
            peer.stop()


def test_an_uncaught_peer_failure_ends_a_script_with_76_and_leaves_an_interactive_session(monkeypatch, capsys):
    from meshfit.distribute._liveness._heartbeat import PeerFailureError, _PeerFailureHook

    others: list[type] = []
    hook = _PeerFailureHook(lambda kind, value, tb: others.append(kind))
    failure = PeerFailureError("Worker 1 stopped (worker 1 at 127.0.0.1:1234)", rank=1)
    monkeypatch.delattr("sys.ps1", raising=False)
    with pytest.raises(SystemExit) as ended:
        hook(PeerFailureError, failure, None)
    assert ended.value.code == PEER_FAILURE_EXIT_CODE
    monkeypatch.setattr("sys.ps1", ">>> ", raising=False)
    hook(PeerFailureError, failure, None)  # the prompt comes back
    hook(ValueError, ValueError("x"), None)
    assert others == [ValueError]
    assert capsys.readouterr().err.count("meshfit: PeerFailureError: Worker 1 stopped (worker 1 at 127.0.0.1:1234)") == 2
