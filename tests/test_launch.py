"""`meshfit launch`: real worker processes, prefixes, failure handling, restarts, signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from _procs import pid_alive

from meshfit._runtime._exit_codes import PEER_FAILURE_EXIT_CODE, PREEMPTED_EXIT_CODE
from meshfit._runtime._launch import main
from meshfit.cluster import TFConfigClusterResolver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = """\
import json, os, signal, subprocess, sys, time
TASK = json.loads(os.environ["TF_CONFIG"])["task"]
KIND, INDEX = TASK["type"], TASK["index"]
ROUND = int(os.environ["MESHFIT_RESTART_COUNT"])
OUT = sys.argv[1]

def record(name, value):
    path = os.path.join(OUT, name)
    with open(path + ".tmp", "w") as f:
        f.write(str(value))
    os.replace(path + ".tmp", path)

record(f"pid-{KIND}{INDEX}-r{ROUND}", os.getpid())
"""


def _script(tmp_path, body: str) -> list[str]:
    """Write a worker script; return ``[script, out_dir]`` for the launcher's argv."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    path = tmp_path / "job.py"
    path.write_text(PRELUDE + textwrap.dedent(body))
    return [str(path), str(out)]


def _pids(tmp_path) -> list[int]:
    out = tmp_path / "out"
    return [int((out / name).read_text()) for name in os.listdir(out) if name.startswith("pid-")
            and not name.endswith(".tmp")]


def _assert_dead(pids: list[int], timeout: float = 5.0) -> None:
    """Every pid is gone or a zombie within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if pid_alive(p)]
        time.sleep(0.05)
    assert not alive, f"processes left running: {alive}"


@pytest.mark.slow  # starts processes
def test_workers_get_their_tf_config_and_prefixed_output(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "7")
    argv = _script(tmp_path, """
        print(f"hello from index {INDEX}")
        print(f"warning from {INDEX}", file=sys.stderr)
        record(f"env-{KIND}{INDEX}", json.dumps({k: os.environ[k] for k in
               ("TF_CONFIG", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONUNBUFFERED")}))
        record(f"args-{INDEX}", json.dumps(sys.argv[2:]))
    """)
    assert main(["--workers", "2", "--threads", "3", *argv, "--workers", "9"]) == 0
    out, err = capfd.readouterr()
    assert "[worker 0] hello from index 0" in out and "[worker 1] hello from index 1" in out
    assert "[worker 0] warning from 0" in err and "[worker 1] warning from 1" in err
    resolvers = []
    for i in range(2):
        env = json.loads((tmp_path / "out" / f"env-worker{i}").read_text())
        assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"], env["PYTHONUNBUFFERED"]) == ("3", "7", "1")
        resolvers.append(TFConfigClusterResolver(env["TF_CONFIG"]))
        assert json.loads((tmp_path / "out" / f"args-{i}").read_text()) == ["--workers", "9"]
    assert [(r.rank, r.world_size, r.is_chief) for r in resolvers] == [(0, 2, True), (1, 2, False)]
    assert resolvers[0].cluster_spec() == resolvers[1].cluster_spec()
    assert len(set(resolvers[0].cluster_spec()["worker"])) == 2
    _assert_dead(_pids(tmp_path))


def test_failed_worker_stops_the_others_quickly(tmp_path, capfd):
    argv = _script(tmp_path, """
        if INDEX == 1:
            while not os.path.exists(os.path.join(OUT, "grandchild")):
                time.sleep(0.02)
            sys.exit(3)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        record("pid-grandchild", child.pid)
        record("grandchild", child.pid)
        time.sleep(60)
    """)
    start = time.monotonic()
    code = main(["--workers", "2", *argv])
    elapsed = time.monotonic() - start
    assert code == 3
    assert elapsed < 15, elapsed
    err = capfd.readouterr().err
    assert "worker 1 exited with code 3; no restarts left" in err
    pids = _pids(tmp_path)
    assert len(pids) == 3
    _assert_dead(pids)


@pytest.mark.slow  # starts processes
def test_max_restarts_restarts_the_group_with_fresh_ports(tmp_path, capfd):
    argv = _script(tmp_path, """
        record(f"tf-{INDEX}-r{ROUND}", os.environ["TF_CONFIG"])
        if ROUND == 0 and INDEX == 1:
            deadline = time.monotonic() + 60  # fail once worker 0 has started (on a loaded machine it may lag)
            while not os.path.exists(os.path.join(OUT, "tf-0-r0")) and time.monotonic() < deadline:
                time.sleep(0.05)
            sys.exit(1)
        if ROUND == 0:
            time.sleep(60)
        print(f"round {ROUND} done")
    """)
    assert main(["--workers", "2", "--max-restarts", "2", *argv]) == 0
    out, err = capfd.readouterr()
    assert "worker 1 exited with code 1; restarting the group (restart 1 of 2)" in err
    assert "[worker 0] round 1 done" in out and "[worker 1] round 1 done" in out
    first = json.loads((tmp_path / "out" / "tf-0-r0").read_text())["cluster"]["worker"]
    second = json.loads((tmp_path / "out" / "tf-0-r1").read_text())["cluster"]["worker"]
    assert first != second
    _assert_dead(_pids(tmp_path))


@pytest.mark.slow  # starts processes
def test_the_killed_worker_is_named_not_the_one_that_followed_it(tmp_path, capfd):
    # Worker 1 is killed; worker 0 waits for its death and ends as a worker that saw a peer stop does.
    # Both have ended by the launcher's next look (a 3-s interval), which meets worker 0 first.
    argv = _script(tmp_path, f"""
        if ROUND == 0 and INDEX == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if ROUND == 0 and INDEX == 0:
            deadline = time.monotonic() + 30
            while not os.path.exists(os.path.join(OUT, "pid-worker1-r0")) and time.monotonic() < deadline:
                time.sleep(0.01)
            peer = int(open(os.path.join(OUT, "pid-worker1-r0")).read())
            while time.monotonic() < deadline:
                try:
                    state = open(f"/proc/{{peer}}/stat").read().rsplit(")", 1)[1].split()[0]
                except OSError:
                    break
                if state == "Z":
                    break
                time.sleep(0.01)
            sys.exit({PEER_FAILURE_EXIT_CODE})
        print(f"finished in round {{ROUND}}")
    """)
    assert main(["--workers", "2", "--max-restarts", "1", "--monitor-interval", "3", *argv]) == 0
    out, err = capfd.readouterr()
    assert "worker 1 exited with code -9; restarting the group (restart 1 of 1)" in err, err
    assert f"exited with code {PEER_FAILURE_EXIT_CODE}" not in err, err
    assert "[worker 0] finished in round 1" in out and "[worker 1] finished in round 1" in out
    _assert_dead(_pids(tmp_path))


@pytest.mark.slow  # starts processes
def test_a_worker_that_followed_a_peer_is_said_to_have(tmp_path, capfd):
    argv = _script(tmp_path, """
        if INDEX == 1:
            sys.exit(PEER_FAILURE_EXIT_CODE)
        time.sleep(60)
    """.replace("PEER_FAILURE_EXIT_CODE", str(PEER_FAILURE_EXIT_CODE)))
    assert main(["--workers", "2", *argv]) == PEER_FAILURE_EXIT_CODE
    err = capfd.readouterr().err
    assert (f"worker 1 exited with code {PEER_FAILURE_EXIT_CODE} (a peer stopped first); "
            "no restarts left") in err, err
    _assert_dead(_pids(tmp_path))


@pytest.mark.slow  # starts processes
def test_restarts_exhausted_returns_the_workers_code(tmp_path, capfd):
    argv = _script(tmp_path, """
        if INDEX == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    assert main(["--workers", "2", "--max-restarts", "1", *argv]) == 128 + signal.SIGKILL
    err = capfd.readouterr().err
    assert "worker 0 exited with code -9; restarting the group (restart 1 of 1)" in err
    assert "worker 0 exited with code -9; no restarts left (--max-restarts 1)" in err
    _assert_dead(_pids(tmp_path))


@pytest.mark.slow  # starts processes
def test_preempted_exit_code_restarts_without_spending_a_restart(tmp_path, capfd):
    argv = _script(tmp_path, f"""
        if ROUND == 0:
            sys.exit({PREEMPTED_EXIT_CODE})
        if ROUND == 1 and INDEX == 1:
            sys.exit(1)
        print(f"finished in round {{ROUND}}")
    """)
    assert main(["--workers", "2", "--max-restarts", "1", *argv]) == 0
    out, err = capfd.readouterr()
    assert f"exited with code {PREEMPTED_EXIT_CODE} (preempted); restarting the group (preemption restart 1" in err
    assert "worker 1 exited with code 1; restarting the group (restart 1 of 1)" in err
    assert "[worker 0] finished in round 2" in out
    _assert_dead(_pids(tmp_path))


@pytest.mark.slow  # starts processes
def test_evaluator_exit_does_not_fail_and_is_stopped_after_training(tmp_path, capfd):
    argv = _script(tmp_path, """
        if KIND == "evaluator":
            print("evaluating")
            if ROUND == 0:
                sys.exit(2)
        print("training")
    """)
    assert main(["--workers", "1", "--evaluator", *argv]) == 0
    out, err = capfd.readouterr()
    assert "[evaluator 0] evaluating" in out and "[worker 0] training" in out
    _assert_dead(_pids(tmp_path))

    argv = _script(tmp_path, """
        if KIND == "evaluator":
            time.sleep(60)
    """)
    start = time.monotonic()
    assert main(["--workers", "2", "--evaluator", "--evaluator-timeout", "0.3", *argv]) == 0
    assert time.monotonic() - start < 15
    assert "evaluator 0 still running" in capfd.readouterr().err
    _assert_dead(_pids(tmp_path))


@pytest.mark.parametrize("argv, match", [
    (["--workers", "0", "x.py"], "--workers"),
    (["--max-restarts", "-1", "x.py"], "--max-restarts"),
    (["does_not_exist.py"], "not found"),
    ([], "script"),
    (["--monitor-interval", "nan", "x.py"], "--monitor-interval: expected a finite number"),
    (["--monitor-interval", "inf", "x.py"], "--monitor-interval: expected a finite number"),
    (["--evaluator-timeout", "nan", "x.py"], "--evaluator-timeout: expected a finite number"),
    (["--foo"], "unknown option '--foo'"),
    (["--workers", "2", "--foo"], "unknown option '--foo'"),
    (["--foo=1", "x.py"], "unknown option '--foo=1'"),
])
def test_bad_arguments_exit_2(argv, match, capfd):
    assert main(argv) == 2
    assert match in capfd.readouterr().err


def test_sigterm_to_launcher_is_forwarded(tmp_path):
    argv = _script(tmp_path, """
        def on_term(signum, frame):
            print(f"worker {INDEX} got SIGTERM", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        record(f"ready-{INDEX}", 1)
        time.sleep(60)
    """)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    launcher = subprocess.Popen([sys.executable, "-m", "meshfit._runtime._launch", "--workers", "2", *argv], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / "out" / f"ready-{i}").exists() for i in range(2)):
            assert time.monotonic() < deadline and launcher.poll() is None, "workers did not start"
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate(timeout=10)
    assert launcher.returncode == 128 + signal.SIGTERM, err
    out_text = out.decode()
    assert "[worker 0] worker 0 got SIGTERM" in out_text and "[worker 1] worker 1 got SIGTERM" in out_text
    assert "received SIGTERM" in err.decode()
    _assert_dead(_pids(tmp_path))
