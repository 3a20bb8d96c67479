"""`meshfit launch --preload`: every task, first round and restarts, is a fork of one process that
imported torch once, and runs its script as ``python script.py`` would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid

import pytest
from _procs import child_env, finish, pids_carrying, start, wait_until

from meshfit._runtime._supervisor import Child

pytestmark = pytest.mark.timeout(300)

# Runs before the script imports anything: whether torch was there already.
PROBE = """\
import gc, sys
PRELOADED = all(m in sys.modules for m in ("torch", "torch._dynamo", "meshfit"))
FROZEN = gc.get_freeze_count()  # what the fork server imported, frozen there (_fork_server_heap.py)
# Frozen after the server's last import, not at `import meshfit`: a module imported later is frozen too
LATE_FROZEN = PRELOADED and all(vars(sys.modules["meshfit.metrics"]) is not o for o in gc.get_objects())
import atexit, json, multiprocessing, os, signal, threading, time
import numpy as np
import torch

TASK = json.loads(os.environ["TF_CONFIG"])["task"]
INDEX, ROUND = TASK["index"], int(os.environ["MESHFIT_RESTART_COUNT"])
OUT = sys.argv[1]

def record(name, value):
    with open(os.path.join(OUT, name + ".tmp"), "w") as f:
        f.write(json.dumps(value))
    os.replace(os.path.join(OUT, name + ".tmp"), os.path.join(OUT, name))

def late():
    time.sleep(0.3)
    record(f"thread-{INDEX}-r{ROUND}", True)

threading.Thread(target=late).start()  # non-daemon: joined before the atexit handlers run
atexit.register(lambda: record(f"atexit-{INDEX}-r{ROUND}", os.path.exists(os.path.join(OUT, f"thread-{INDEX}-r{ROUND}"))))
record(f"seen-{INDEX}-r{ROUND}", {
    "preloaded": PRELOADED, "frozen": FROZEN, "late_frozen": LATE_FROZEN, "pid": os.getpid(), "ppid": os.getppid(), "session_leader": os.getsid(0) == os.getpid(),
    "argv": sys.argv[2:], "path0": sys.path[0], "name": __name__, "process": multiprocessing.current_process().name,
    "numpy": float(np.random.rand()), "threads": torch.get_num_threads(), "stdin": sys.stdin.read(),
    "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PYTHONUNBUFFERED", "MESHFIT_TEST_PRELOAD",
                                           "MESHFIT_PRELOAD_SERVER") if k in os.environ}})
print(f"worker {INDEX} round {ROUND} out", flush=True)
print(f"worker {INDEX} round {ROUND} err", file=sys.stderr, flush=True)
"""


def _job(tmp_path, tail: str) -> tuple[str, str]:
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "job.py"
    script.write_text(PROBE + textwrap.dedent(tail))
    return str(script), str(out)


def _launch(*argv: str, token: str, timeout: float = 240) -> tuple[int, str]:
    """Run ``meshfit launch argv...``; its exit code and output. Fails if a process of the job outlives
    the launcher by more than 10 s (the fork server included)."""
    proc = start(["-m", "meshfit._cli", "launch", *argv], child_env(MESHFIT_TEST_PRELOAD=token))
    try:
        code, output = finish(proc, timeout=timeout)
        assert wait_until(lambda: _with_token(token) == [], 10), (_with_token(token), output)
        return code, output
    finally:
        _end_leftovers(token)


def _with_token(token: str) -> list[int]:
    return pids_carrying("MESHFIT_TEST_PRELOAD", token)


def _end_leftovers(token: str) -> None:
    for pid in _with_token(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _seen(out: str, name: str) -> dict:
    with open(os.path.join(out, name)) as f:
        return json.load(f)


def test_every_task_is_a_fork_of_one_preloaded_process_and_sees_what_a_new_interpreter_sees(tmp_path):
    script, out = _job(tmp_path, "")
    token = uuid.uuid4().hex
    code, output = _launch("--workers", "2", "--preload", script, out, "--lr", "0.1", token=token)
    assert code == 0, output
    seen = [_seen(out, f"seen-{i}-r0") for i in range(2)]
    assert all(s["preloaded"] for s in seen), seen  # torch was imported before the script's first line
    # ... and frozen by the server (gc.freeze), so that no collection of the task walks it
    assert all(s["frozen"] > 100_000 and s["late_frozen"] for s in seen), seen
    assert seen[0]["ppid"] == seen[1]["ppid"], seen  # one parent: the fork server
    assert len({s["pid"] for s in seen} | {seen[0]["ppid"]}) == 3, seen
    for s in seen:
        assert s["session_leader"], s  # the launcher signals its whole process group
        assert s["argv"] == ["--lr", "0.1"] and s["name"] == "__main__", s
        assert s["path0"] == os.path.dirname(script), s
        assert s["process"] == "MainProcess" and s["stdin"] == "", s
        assert s["threads"] == 1, s
        assert s["env"] == {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MESHFIT_TEST_PRELOAD": token}, s
        assert _seen(out, f"atexit-{seen.index(s)}-r0") is True  # atexit ran, after the thread was joined
    assert seen[0]["numpy"] != seen[1]["numpy"], seen  # NumPy's global state drawn again in each task
    assert "round 0: starting 2 worker(s), forked from the preloaded process:" in output, output
    for i in range(2):
        assert f"[worker {i}] worker {i} round 0 out" in output and f"[worker {i}] worker {i} round 0 err" in output


def test_without_preload_the_same_probe_is_a_new_interpreter(tmp_path):
    script, out = _job(tmp_path, "")
    token = uuid.uuid4().hex
    code, output = _launch("--workers", "2", script, out, token=token)
    assert code == 0, output
    seen = [_seen(out, f"seen-{i}-r0") for i in range(2)]
    assert not any(s["preloaded"] for s in seen), seen
    assert not any(s["frozen"] for s in seen), seen


def test_a_killed_task_restarts_as_a_new_fork_and_an_uncaught_exception_prints_the_scripts_traceback(tmp_path):
    script, out = _job(tmp_path, """
        if ROUND == 0 and INDEX == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if ROUND == 1 and INDEX == 0:
            raise ValueError("a bad batch")
        """)
    token = uuid.uuid4().hex
    code, output = _launch("--workers", "2", "--max-restarts", "1", "--preload", script, out, token=token)
    assert code == 1, output
    assert "worker 1 exited with code -9; restarting the group" in output, output
    assert "worker 0 exited with code 1; no restarts left" in output, output
    rounds = [_seen(out, f"seen-0-r{r}") for r in range(2)]
    assert rounds[0]["ppid"] == rounds[1]["ppid"] and rounds[0]["pid"] != rounds[1]["pid"], rounds
    assert rounds[1]["preloaded"], rounds
    traceback = output[output.index("[worker 0] Traceback"):]
    # the frames python script.py prints: the script's own, not the fork server's or runpy's
    assert traceback.splitlines()[1].startswith(f'[worker 0]   File "{script}", line '), traceback
    assert "_preload.py" not in traceback and "runpy" not in traceback, traceback
    assert "[worker 0] ValueError: a bad batch" in output, output


@pytest.mark.parametrize(("ending", "code", "printed"), [
    ("sys.exit(3)", 3, None),
    ("sys.exit('stopping: no data')", 1, "stopping: no data"),
    # a sys.excepthook that exits (as meshfit's does after a peer failure) sets the code, and the
    # atexit handlers still run, as in python
    ("import atexit; atexit.register(print, 'atexit ran', flush=True); "
     "sys.excepthook = lambda *a: sys.exit(76); raise ValueError('a bad batch')", 76, "atexit ran"),
])
def test_sys_exit_in_a_preloaded_task_is_its_exit_code(tmp_path, ending, code, printed):
    script, out = _job(tmp_path, f"""
        if INDEX == 0:
            {ending}
        """)
    token = uuid.uuid4().hex
    got, output = _launch("--workers", "2", "--preload", script, out, token=token)
    assert f"worker 0 exited with code {code}" in output, output
    assert got == code, output
    if printed is not None:
        assert f"[worker 0] {printed}" in output, output


def test_a_module_runs_with_dash_m(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    token = uuid.uuid4().hex
    proc = start(["-m", "meshfit._cli", "launch", "--workers", "2", "--preload", "-m", "pkg.job", str(out)],
                 child_env(MESHFIT_TEST_PRELOAD=token), cwd=str(tmp_path))
    try:
        code, output = finish(proc, timeout=240)
    finally:
        _end_leftovers(token)
    assert code == 0, output
    seen = _seen(str(out), "seen-1-r0")
    assert seen["preloaded"] and seen["name"] == "__main__" and seen["path0"] == str(tmp_path), seen


def test_preload_and_standby_together_are_refused_by_name(tmp_path):
    script, out = _job(tmp_path, "")
    token = uuid.uuid4().hex
    code, output = _launch("--preload", "--standby", script, out, token=token, timeout=60)
    assert code == 2, output
    assert "--preload and --standby" in output, output


def test_a_launcher_killed_by_sigterm_ends_its_preloaded_tasks(tmp_path):
    script, out = _job(tmp_path, """
        time.sleep(120)
        """)
    token = uuid.uuid4().hex
    proc = start(["-m", "meshfit._cli", "launch", "--workers", "2", "--preload", script, out],
                 child_env(MESHFIT_TEST_PRELOAD=token))
    try:
        assert wait_until(lambda: all(os.path.exists(os.path.join(out, f"seen-{i}-r0")) for i in range(2)), 120)
        proc.send_signal(signal.SIGTERM)
        code, output = finish(proc, timeout=60)
        assert code == 128 + signal.SIGTERM, output
        assert wait_until(lambda: _with_token(token) == [], 10), _with_token(token)
    finally:
        _end_leftovers(token)


def test_a_task_signalled_before_it_leads_its_own_session_still_gets_the_signal():
    # A forked task calls setsid() a moment after the fork server reports its pid; until then there
    # is no process group of that id, and the supervisor signals the process itself.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # in our session
    try:
        Child("worker", 0, proc, own_session=True).send(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()


def test_a_preloaded_task_runs_a_torch_dataloader_with_worker_processes_of_each_start_method(tmp_path):
    script = tmp_path / "loader.py"
    script.write_text(textwrap.dedent("""\
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        def main():
            data = TensorDataset(torch.arange(16.0))
            for method in ("fork", "spawn", "forkserver"):
                loader = DataLoader(data, batch_size=4, shuffle=True, num_workers=2, multiprocessing_context=method,
                                    generator=torch.Generator().manual_seed(7))
                print(method, sorted(int(x) for batch in loader for x in batch[0]), flush=True)

        if __name__ == "__main__":
            main()
        """))
    token = uuid.uuid4().hex
    code, output = _launch("--workers", "1", "--preload", str(script), token=token)
    assert code == 0, output
    for method in ("fork", "spawn", "forkserver"):
        assert f"[worker 0] {method} {list(range(16))}" in output, output
