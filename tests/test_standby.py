"""`meshfit launch --standby`: a restarted group runs in warm processes that already imported torch."""

from __future__ import annotations

import json
import os
import textwrap
import time
import uuid

import pytest
from _procs import pids_carrying

from meshfit._runtime._launch import main

# Runs before anything imports torch: whether this process had torch before the script started.
PRELUDE = """\
import sys
PRELOADED = all(m in sys.modules for m in ("torch", "torch._dynamo", "meshfit.callbacks", "meshfit.distribute"))
import json, os, signal, time
TASK = json.loads(os.environ["TF_CONFIG"])["task"]
INDEX, ROUND = TASK["index"], int(os.environ["MESHFIT_RESTART_COUNT"])
OUT = sys.argv[1]

def record(name, value):
    path = os.path.join(OUT, name)
    with open(path + ".tmp", "w") as f:
        f.write(json.dumps(value))
    os.replace(path + ".tmp", path)

def standby_pids():
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if TOKEN in environ and b"from meshfit._runtime._standby import main" in cmdline:
            pids.append(int(pid))
    return pids

TOKEN = ("MESHFIT_TEST_STANDBY=" + os.environ["MESHFIT_TEST_STANDBY"]).encode()
record(f"seen-{INDEX}-r{ROUND}", {"preloaded": PRELOADED, "argv": sys.argv[2:], "name": __name__,
       "path0": sys.path[0], "pid": os.getpid(),
       "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PYTHONUNBUFFERED", "TF_CONFIG")}})
"""

KILL_WORKER_1_IN_ROUND_0 = """
if ROUND == 0:
    if INDEX == 1:
        deadline = time.monotonic() + 60  # fail once the standbys are up (they import torch: seconds)
        # and worker 0 has recorded its cold start (on a loaded machine it may not have run a line yet)
        while ((len(standby_pids()) < 2 or not os.path.exists(os.path.join(OUT, "seen-0-r0")))
               and time.monotonic() < deadline):
            time.sleep(0.1)
        {before_failing}
        sys.exit(1)
    time.sleep(60)
print(f"round {{ROUND}} done")
"""


def _job(tmp_path, before_failing: str = "pass") -> tuple[str, str]:
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + textwrap.dedent(KILL_WORKER_1_IN_ROUND_0.format(before_failing=before_failing)))
    return str(script), str(out)


def _seen(out: str, index: int, round_: int) -> dict:
    with open(os.path.join(out, f"seen-{index}-r{round_}")) as f:
        return json.load(f)


def _assert_none_left(token: str, timeout: float = 5.0) -> None:
    """No process still carries this test's token (standbys or workers)."""
    deadline = time.monotonic() + timeout
    while (left := pids_carrying("MESHFIT_TEST_STANDBY", token)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left running: {left}"


@pytest.fixture
def token(monkeypatch):
    value = uuid.uuid4().hex
    monkeypatch.setenv("MESHFIT_TEST_STANDBY", value)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield value
    _assert_none_left(value)


@pytest.mark.slow  # starts processes
def test_a_restarted_group_runs_in_warm_standbys_as_the_cold_script_would(tmp_path, capfd, token):
    script, out = _job(tmp_path)
    assert main(["--workers", "2", "--max-restarts", "1", "--standby", script, out, "--lr", "0.1"]) == 0
    stdout, err = capfd.readouterr()
    assert "round 1: 2 of 2 process(es) from warm standbys" in err
    assert "[worker 0] round 1 done" in stdout and "[worker 1] round 1 done" in stdout
    for index in (0, 1):
        cold, warm = _seen(out, index, 0), _seen(out, index, 1)
        assert not cold["preloaded"] and warm["preloaded"]  # the standby had imported torch and meshfit
        for seen in (cold, warm):  # what `python job.py out --lr 0.1` gives a script
            assert seen["argv"] == ["--lr", "0.1"] and seen["name"] == "__main__"
            assert seen["path0"] == os.path.dirname(script)
            assert (seen["env"]["OMP_NUM_THREADS"], seen["env"]["PYTHONUNBUFFERED"]) == ("1", "1")
        assert json.loads(warm["env"]["TF_CONFIG"])["task"] == {"type": "worker", "index": index}
        assert json.loads(warm["env"]["TF_CONFIG"]) != json.loads(cold["env"]["TF_CONFIG"])  # fresh ports


@pytest.mark.slow  # starts processes
def test_dead_standbys_are_replaced_by_cold_starts(tmp_path, capfd, token):
    script, out = _job(tmp_path, before_failing="[os.kill(p, signal.SIGKILL) for p in standby_pids()]")
    assert main(["--workers", "2", "--max-restarts", "1", "--standby", script, out]) == 0
    stdout, err = capfd.readouterr()
    assert "from warm standbys" not in err
    assert "[worker 0] round 1 done" in stdout and "[worker 1] round 1 done" in stdout
    assert not _seen(out, 0, 1)["preloaded"] and not _seen(out, 1, 1)["preloaded"]


@pytest.mark.slow  # starts processes
def test_module_mode_runs_the_module_as_main_from_the_working_directory(tmp_path, capfd, token, monkeypatch):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    script, out = _job(tmp_path)
    os.replace(script, package / "job.py")
    monkeypatch.chdir(tmp_path)
    assert main(["--workers", "2", "--max-restarts", "1", "--standby", "-m", "pkg.job", out]) == 0
    assert "round 1: 2 of 2 process(es) from warm standbys" in capfd.readouterr().err
    warm = _seen(out, 0, 1)
    assert warm["preloaded"] and warm["name"] == "__main__" and warm["path0"] == str(tmp_path)
