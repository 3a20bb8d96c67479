"""Forming the group: the store binds the configured address only; settings that must agree are
compared at start; a worker waiting for a peer says so; group creation is bounded by meshfit's timeout."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time

import pytest
from _procs import child_env, finish, free_ports, kill_group, start, tf_config, wait_until

import meshfit as mf
from meshfit.distribute._liveness._rendezvous import (
    ClusterMismatchError,
    agree_on_settings,
    interface_holding,
)

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
CUSTOM = os.path.join(SCRIPTS, "watched_loop.py")


def _listening(pids: set[int]) -> list[str]:
    """The local addresses that ``pids`` listen on (TCP), from ``ss -ltnp``."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if owners & pids:
            found.append(line.split()[3])
    return found


def test_workers_listen_only_on_the_configured_address(tmp_path):
    ports = free_ports(2)
    args = [CUSTOM, "--out", str(tmp_path), "--steps", "200", "--sleep", "0.05"]
    procs = [start(args, child_env(TF_CONFIG=tf_config(ports, rank))) for rank in (0, 1)]
    try:
        pids = {p.pid for p in procs}
        # rank 0's store and both workers' gloo listeners are up once the store port listens
        assert wait_until(lambda: any(a.endswith(f":{ports[0]}") for a in _listening(pids)), 60)
        time.sleep(2)
        addresses = _listening(pids)
        assert addresses, addresses
        assert all(a.startswith("127.0.0.1:") for a in addresses), addresses  # never *:port or 0.0.0.0
        assert f"127.0.0.1:{ports[0]}" in addresses  # the rendezvous store, on TF_CONFIG's address
    finally:
        for p in procs:
            kill_group(p)
            finish(p, timeout=30)


def _tf(workers: list[str], index: int) -> str:
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})


def test_different_cluster_lists_fail_at_once_naming_the_setting(tmp_path):
    ports = free_ports(3)
    two = [f"127.0.0.1:{p}" for p in ports[:2]]
    args = [CUSTOM, "--out", str(tmp_path), "--steps", "5"]
    procs = [start(args, child_env(TF_CONFIG=_tf(two, 0))),
             start(args, child_env(TF_CONFIG=_tf(two + [f"127.0.0.1:{ports[2]}"], 1)))]
    started = time.monotonic()
    results = [finish(p, timeout=120) for p in procs]
    assert time.monotonic() - started < 30  # not the collective timeout (300 s)
    for code, output in results:
        assert code != 0, output
        assert "workers disagree on settings" in output or "another worker stopped the start" in output, output
    text = results[0][1] + results[1][1]
    assert "world_size: worker 0 at" in text and "has 2" in text and "has 3" in text, text


def test_a_duplicate_task_index_fails_at_once(tmp_path):
    ports = free_ports(3)
    three = [f"127.0.0.1:{p}" for p in ports]
    args = [CUSTOM, "--out", str(tmp_path), "--steps", "5"]
    procs = [start(args, child_env(TF_CONFIG=_tf(three, i))) for i in (0, 1, 1)]
    started = time.monotonic()
    results = [finish(p, timeout=120) for p in procs]
    assert time.monotonic() - started < 30
    assert any("two workers were started as rank 1" in out for _, out in results), results
    assert all(code != 0 for code, _ in results), results


def test_two_workers_given_index_0_both_fail_within_seconds_naming_it(tmp_path):
    # The second claimant cannot listen on rank 0's address; it finds this job's rank 0 there and says
    # so to it, which would otherwise wait out the rendezvous timeout (300 s) for a worker 1.
    ports = free_ports(2)
    args = [CUSTOM, "--out", str(tmp_path), "--steps", "5"]
    procs = [start(args, child_env(TF_CONFIG=tf_config(ports, 0))) for _ in range(2)]
    started = time.monotonic()
    results = [finish(p, timeout=120) for p in procs]
    assert time.monotonic() - started < 30  # the start itself is slow under load; not the 300 s timeout
    for code, output in results:
        assert code != 0, output
        assert f"two workers were started as rank 0 (worker 0 at 127.0.0.1:{ports[0]})" in output, output


def test_an_unresolvable_host_is_named(tmp_path):
    ports = free_ports(2)
    workers = [f"no-such-host.invalid:{ports[0]}", f"127.0.0.1:{ports[1]}"]
    proc = start([CUSTOM, "--out", str(tmp_path), "--steps", "5"], child_env(TF_CONFIG=_tf(workers, 1)))
    code, output = finish(proc, timeout=60)
    assert code != 0
    assert "names host 'no-such-host.invalid', which does not resolve" in output, output


def test_a_worker_waiting_for_an_absent_chief_says_so(tmp_path):
    ports = free_ports(2)
    proc = start([CUSTOM, "--out", str(tmp_path), "--steps", "5"], child_env(TF_CONFIG=tf_config(ports, 1)))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        assert wait_until(lambda: sum("is waiting for" in x for x in lines) >= 2, 40), lines
    finally:
        kill_group(proc)
        finish(proc, timeout=30)
    first = next(x for x in lines if "is waiting for" in x)
    assert f"worker 1 at 127.0.0.1:{ports[1]} is waiting for worker 0 at 127.0.0.1:{ports[0]}" in first, first
    assert re.search(r"\(\d+ s of 300 s\)", first), first


def test_interface_holding_finds_loopback():
    assert interface_holding("127.0.0.1") == "lo"
    assert interface_holding("::1") == "lo"
    assert interface_holding("203.0.113.77") is None  # TEST-NET-3: held by no interface here


def test_agree_on_settings_names_each_workers_value():
    class TwoWorkers:  # the all-gather of two workers that disagree on steps_per_epoch
        def all_gather_object(self, obj):
            return [obj, {**obj, "steps_per_epoch": 7}]

    agree_on_settings(type("Same", (), {"all_gather_object": lambda self, o: [o, o]})(), {"a": 1}, "fit")
    with pytest.raises(ClusterMismatchError, match=r"steps_per_epoch: worker 0 has 5, worker 1 has 7"):
        agree_on_settings(TwoWorkers(), {"steps_per_epoch": 5, "save_freq": "epoch"}, "fit")


_NEW_GROUP_AFTER_PEER_DIED = r"""
import os, sys, time, torch.distributed as dist, meshfit as mf
strategy = mf.MultiWorkerMirroredStrategy(communication_options=mf.CommunicationOptions(timeout_seconds=5))
if strategy.replica_id == 1:
    os._exit(0)  # gone before the group below is created
started = time.monotonic()
try:
    strategy.world.new_group(backend="gloo")  # every group creation gets the World's timeout
    print("created")
except Exception as error:
    print(f"new_group failed after {time.monotonic() - started:.1f} s: {type(error).__name__}", flush=True)
os._exit(3)
"""


def test_group_creation_is_bounded_by_the_configured_timeout(tmp_path):
    ports = free_ports(2)
    script = tmp_path / "new_group.py"
    script.write_text(_NEW_GROUP_AFTER_PEER_DIED)
    procs = [start([str(script)], child_env(TF_CONFIG=tf_config(ports, r))) for r in (0, 1)]
    code, output = finish(procs[0], timeout=120)
    finish(procs[1], timeout=30)
    match = re.search(r"new_group failed after ([\d.]+) s", output)
    assert match, output
    assert float(match.group(1)) < 20, output  # torch's default would be 30 minutes


def test_communication_options_timeout_reaches_the_group():
    strategy = mf.MultiWorkerMirroredStrategy(communication_options=mf.CommunicationOptions(timeout_seconds=12))
    assert strategy.world.timeout.total_seconds() == 12


@pytest.mark.parametrize("failing", ["check", "wait"])
def test_a_store_that_goes_away_while_settings_are_compared_is_named_not_a_raw_network_error(failing):
    """The store's host may find the mismatch first and end, taking the store along: the other worker says
    another worker stopped the start, instead of torch's "Failed to recv" traceback (whether the store went
    away at the abort check or while waiting for a peer's settings, which is not a peer still starting)."""
    from datetime import timedelta

    import torch.distributed as dist

    from meshfit.distribute._liveness._rendezvous import ClusterMismatchError, agree_at_start

    def gone(*args):
        raise dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")

    class Gone:
        def add(self, key, value):
            return 1

        def set(self, key, value):
            pass

        def check(self, keys):
            return gone() if failing == "check" else False

        def wait(self, keys, timeout):
            gone()

    with pytest.raises(ClusterMismatchError, match=r"another worker stopped the start: the rendezvous store "
                                                   r"went away while worker 1 compared settings"):
        agree_at_start(Gone(), 1, 2, {"world_size": 2}, ["worker 0", "worker 1"], timedelta(seconds=5))
