"""Warm standbys for ``meshfit launch --standby``: processes that have already imported torch and meshfit.

A restarted worker spends most of its way back to the first resumed step importing (torch,
meshfit, and ``torch._dynamo``, which DDP's constructor imports): a ``kill -9`` to the first resumed
step on 2 workers took 3.2 s here cold and 0.8 s from standbys (``bench/bench_recovery.py``), and
far more cold on a loaded machine. With
``--standby`` the launcher keeps one waiting process per task of the group, started with the
workers' environment less the per-round keys, which has done those imports and blocks on its stdin.
A restart hands each task a standby instead of a cold ``python script.py``: one JSON line with the
round's ``TF_CONFIG`` and ``MESHFIT_RESTART_COUNT`` and the script's argv; the standby sets them and
runs the script as ``__main__`` (``runpy``), with the script's directory first on ``sys.path`` as
``python script.py`` puts it. A standby that has died is replaced by a cold start; new standbys are
started for the next failure once the round is running.

Cost: one idle process per task (~300 MB of memory each) while the job runs. A standby whose
launcher is gone reads end-of-file on its stdin and exits.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence

__all__ = ["ROUND_KEYS", "StandbyPool", "main"]

ROUND_KEYS = ("TF_CONFIG", "MESHFIT_RESTART_COUNT")  # what changes between rounds: sent at activation
# The standby's program. ``-c``, not ``-m``: this module must not run as ``__main__`` beside its
# imported self. The imports are the point: torch, torch._dynamo (DistributedDataParallel's
# constructor imports it, ~1 s) and the whole meshfit package (loaded at its first public name).
_ENTRY = ("import sys, torch, torch._dynamo, torch.distributed, meshfit; meshfit.Model; "
          "from meshfit._runtime._standby import main; sys.exit(main())")


class StandbyPool:
    """Idle processes waiting to become a task of the next round (the launcher's side)."""

    def __init__(self, python: str, env: Mapping[str, str]) -> None:
        self._python = python
        self._env = {k: v for k, v in env.items() if k not in ROUND_KEYS}
        self._waiting: list[subprocess.Popen[bytes]] = []

    def fill(self, count: int) -> None:
        """Start standbys until ``count`` are waiting (dead ones are dropped)."""
        self._waiting = [p for p in self._waiting if p.poll() is None]
        while len(self._waiting) < count:
            self._waiting.append(subprocess.Popen(
                [self._python, "-c", _ENTRY], env=self._env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True))

    def take(self, command: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[bytes] | None:
        """A waiting standby turned into ``command`` (``[python, script, args...]`` or ``[python, -m,
        module, args...]``) with ``env``'s round keys; None when none is alive or ``env`` differs
        from the standbys' in anything but the round keys."""
        if {k: v for k, v in env.items() if k not in ROUND_KEYS} != self._env:
            return None
        while self._waiting:
            proc = self._waiting.pop(0)
            if proc.poll() is not None:
                continue
            module = len(command) > 2 and command[1] == "-m"
            job = {"module": module, "argv": list(command[2:] if module else command[1:]),
                   "env": {k: env[k] for k in ROUND_KEYS if k in env}}
            try:
                if proc.stdin is None:
                    raise OSError("no stdin")
                proc.stdin.write(json.dumps(job).encode() + b"\n")
                proc.stdin.close()
            except OSError:  # it died between poll() and the write
                proc.kill()
                proc.wait()
                continue
            return proc
        return None

    def close(self) -> None:
        """End every waiting standby (its whole session) and reap it."""
        for proc in self._waiting:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        self._waiting.clear()


def main() -> int:
    """The standby process (after ``_ENTRY``'s imports): wait for a job on stdin, run it as ``__main__``."""
    line = sys.stdin.buffer.readline()
    if not line:
        return 0  # the launcher ended before needing us
    job = json.loads(line)
    sys.stdin.close()
    sys.stdin = open(os.devnull)  # noqa: SIM115  # a launched worker reads no stdin
    os.environ.update(job["env"])
    sys.argv = list(job["argv"])
    if job["module"]:
        sys.path[0] = os.getcwd()  # python -m puts the working directory first (-c put "")
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        runpy.run_path(sys.argv[0], run_name="__main__")
    return 0

