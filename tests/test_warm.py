"""The tests' warm interpreter (tests/_warm.py): a script forked from it behaves as ``python script.py``
does for what the multi-process tests look at: argv, environment, working directory, ``sys.path[0]``,
output, exit code (``sys.exit``, an uncaught exception, a signal), ``atexit`` handlers, a session of its
own; the next script sees nothing of the last; commands it cannot run start a fresh interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap

import _warm
import pytest
from _procs import child_env, finish, kill_group, pid_alive, start, wait_until

pytestmark = pytest.mark.slow  # every test here starts processes

SCRIPT = textwrap.dedent("""
    import atexit, json, os, sys, tempfile
    import torch
    atexit.register(lambda: print("atexit ran", flush=True))
    print(json.dumps({"argv": sys.argv, "probe": os.environ.get("WARM_PROBE"), "cwd": os.getcwd(),
                      "path0": sys.path[0], "name": __name__, "tmp": tempfile.gettempdir(),
                      "sid": os.getsid(0) == os.getpid(), "torch": torch.get_num_threads(),
                      "left": os.environ.get("WARM_LEFT")}), flush=True)
    os.environ["WARM_LEFT"] = "left behind"
    mode = sys.argv[1]
    if mode == "exit3":
        sys.exit(3)
    if mode == "raise":
        raise ValueError("the script says no")
    if mode == "sleep":
        print("sleeping", flush=True)
        import time
        time.sleep(600)
""")


def _script(tmp_path) -> str:
    folder = tmp_path / "scripts"
    folder.mkdir(exist_ok=True)
    path = folder / "probe.py"
    path.write_text(SCRIPT)
    return str(path)


def _report(output: str) -> dict:
    import json

    return json.loads(next(line for line in output.splitlines() if line.startswith("{")))


def test_a_warm_script_sees_its_argv_environment_folder_and_runs_its_exit_handlers(tmp_path):
    script = _script(tmp_path)
    env = child_env(WARM_PROBE="one", TMPDIR=str(tmp_path))
    proc = start([script, "ok", "--flag"], env, cwd=str(tmp_path))
    assert isinstance(proc, _warm.WarmProcess)
    code, output = finish(proc, timeout=120)
    assert code == 0, output
    report = _report(output)
    assert report == {"argv": [script, "ok", "--flag"], "probe": "one", "cwd": str(tmp_path),
                      "path0": os.path.dirname(script), "name": "__main__", "tmp": str(tmp_path), "sid": True,
                      "torch": 1, "left": None}
    assert output.rstrip().endswith("atexit ran"), output
    # The next script starts from the server, not from the last one: its own environment only.
    code, output = finish(start([script, "ok"], child_env(WARM_PROBE="two")), timeout=120)
    assert code == 0, output
    assert (_report(output)["probe"], _report(output)["left"]) == ("two", None)


@pytest.mark.parametrize(("mode", "expected", "text"), [("exit3", 3, "atexit ran"),
                                                        ("raise", 1, "ValueError: the script says no")])
def test_a_warm_script_exits_as_python_does(tmp_path, mode, expected, text):
    code, output = finish(start([_script(tmp_path), mode], child_env()), timeout=120)
    assert code == expected, output
    assert text in output, output
    assert "atexit ran" in output, output  # an uncaught exception still runs the exit handlers
    assert "_Become" not in output and "During handling" not in output, output  # no server context


def test_a_warm_script_killed_by_a_signal_reports_it_and_its_group_ends(tmp_path):
    proc = start([_script(tmp_path), "sleep"], child_env())
    try:
        assert proc.stdout.readline().startswith("{")
        assert proc.stdout.readline().strip() == "sleeping"
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert wait_until(lambda: not pid_alive(proc.pid), timeout=10)  # reaped by the server
    finally:
        kill_group(proc)


def test_commands_the_server_cannot_run_start_a_fresh_interpreter(tmp_path):
    command = start(["-c", "print(1)"], child_env())
    assert isinstance(command, subprocess.Popen)
    assert finish(command, timeout=120) == (0, "1\n")
    script = _script(tmp_path)
    fresh = start([script, "ok"], child_env(), fresh=True)
    assert isinstance(fresh, subprocess.Popen)
    assert finish(fresh, timeout=120)[0] == 0
    # An environment torch or meshfit read while importing: the server's imports did not see it.
    changed = start([script, "ok"], child_env(OMP_NUM_THREADS="2"))
    assert isinstance(changed, subprocess.Popen)
    code, output = finish(changed, timeout=120)
    assert code == 0 and _report(output)["torch"] == 2, output


def test_the_warm_server_is_single_threaded_and_a_session_helper(tmp_path):
    finish(start([_script(tmp_path), "ok"], child_env()), timeout=120)
    pid = _warm.server_pid()
    assert pid is not None and pid_alive(pid)
    assert len(os.listdir(f"/proc/{pid}/task")) == 1  # forking it is safe
    from _multiproc import helper_pids

    assert pid in helper_pids()
