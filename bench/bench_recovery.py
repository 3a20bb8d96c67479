"""Recovery, phase by phase: from a worker's ``kill -9`` to the first resumed step, on 2 workers.

Runs ``bench/_resume_worker.py`` (the seed CNN, global batch 128, ``BackupAndRestore(save_freq=10)``;
worker 1 SIGKILLs itself before step 25 of round 0; round 1 resumes from the backup of step 20)
under a launcher that restarts the group:

- ``meshfit launch --workers 2 --max-restarts 1`` (``--launcher meshfit``), and the same with
  ``--standby`` (``--launcher meshfit-standby``: the restarted workers are warm standbys that have
  imported torch, ``torch._dynamo`` and meshfit, so the import phase is ~0), and with ``--preload``
  (``--launcher meshfit-preload``: every task, restarted ones included, is a fork of one process that
  imported them once);
- torchrun's elastic agent (``--launcher torchrun``): ``--nnodes=1:2 --nproc-per-node=2
  --max-restarts=1 --rdzv-backend=c10d --rdzv-conf=join_timeout=60,last_call_timeout=1``, with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (the recipe in the README and ``deploy/``). One host here,
  so the agent restarts its local workers; a multi-host job adds the agents' re-rendezvous.

The phases, in seconds (each worker logs timestamped events; launcher lines are stamped as they arrive):

- detection: kill → the survivor's ``fit`` raises the peer failure (its liveness connection to the dead
  worker closed), and kill → the launcher reports the exit;
- teardown + restart: the launcher's report → the first process of the new round runs Python;
- import (torch, meshfit), rendezvous (``MultiWorkerMirroredStrategy()``), model, fit setup, restore
  (``BackupAndRestore.on_train_begin``), first step: each gated by the slowest worker.

Run:  .venv/bin/python bench/bench_recovery.py [--launcher meshfit|meshfit-standby|meshfit-preload|torchrun|all] [--trials N] [--quick]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
from bench_backup import _events, _kill_workers  # noqa: E402

TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # pytorch#135712, #139702
PHASES = ("detection by the survivor", "detection by the launcher", "teardown + restart (spawn)", "import",
          "rendezvous", "data + model + compile", "fit setup", "restore", "first step", "total")


def command(launcher: str, events_dir: str, backup_dir: str, steps: int) -> list[str]:
    script = [os.path.join(C.BENCH, "_resume_worker.py"), "--events", events_dir, "--backup-dir", backup_dir,
              "--steps", str(steps), "--save-freq", "10", "--kill-rank", "1", "--kill-at", "25"]
    if launcher.startswith("meshfit"):
        standby = {"meshfit-standby": ["--standby"], "meshfit-preload": ["--preload"]}.get(launcher, [])
        return [C.python(), "-m", "meshfit._cli", "launch", "--workers", "2", "--max-restarts", "1", *standby,
                *script]
    port = _free_port()
    return [C.python(), "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=2", "--max-restarts=1",
            "--monitor-interval=0.1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=bench-recovery", "--rdzv-conf=join_timeout=60,last_call_timeout=1", *script]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial(launcher: str, steps: int, timeout: float) -> dict[str, float | None]:
    with tempfile.TemporaryDirectory(prefix="meshfit-bench-recovery-") as tmp:
        events_dir, backup_dir = os.path.join(tmp, "events"), os.path.join(tmp, "backup")
        os.makedirs(events_dir)
        argv = command(launcher, events_dir, backup_dir, steps)
        env = C.clean_env(**(TORCHRUN_ENV if launcher == "torchrun" else {}))
        print(f"\n{launcher}: " + C.command_line(argv, env, ("OMP_NUM_THREADS", *TORCHRUN_ENV)), flush=True)
        child = C.Child(argv, env, launcher)
        try:
            deadline = time.monotonic() + timeout
            while child.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if child.proc.poll() is None:
                os.kill(child.proc.pid, signal.SIGTERM)
                time.sleep(5)
        finally:
            child.kill()
            _kill_workers(events_dir)
        if child.proc.returncode != 0:
            raise RuntimeError(f"{launcher} exited with {child.proc.returncode}; output:\n{child.output}")
        return phases(launcher, events_dir, child)


def phases(launcher: str, events_dir: str, child: C.Child) -> dict[str, float | None]:
    with open(os.path.join(events_dir, "kill-time")) as f:
        killed = float(f.read())
    survivor, resumed = _events(events_dir, 0, 0), [_events(events_dir, r, 1) for r in (0, 1)]
    marks = ("worker 1 exited with code",) if launcher.startswith("meshfit") else ("closing signal", "exitcode")
    reported = next((t for t, line in child.lines if t > killed and any(m in line for m in marks)), None)

    def latest(name: str) -> float:
        return max(r[name]["t"] for r in resumed)

    started = min(r["script_start"]["t"] for r in resumed)
    first = resumed[0]["first_batch_end"]["t"]
    out: dict[str, float | None] = {
        "detection by the survivor": survivor["fit_raised"]["t"] - killed if "fit_raised" in survivor else None,
        "detection by the launcher": None if reported is None else reported - killed,
        "teardown + restart (spawn)": started - (killed if reported is None else reported),
        "import": latest("imports_done") - started,
        "rendezvous": latest("strategy_ready") - latest("imports_done"),
        "data + model + compile": latest("model_ready") - latest("strategy_ready"),
        "fit setup": latest("restore_begin") - latest("fit_called"),
        "restore": latest("restore_end") - latest("restore_begin"),
        "first step": first - latest("restore_end"),
        "total": first - killed,
    }
    for name in PHASES:
        value = out[name]
        print(f"  {name:30s} {'-' if value is None else f'{value:7.3f}'}")
    if "fit_raised" in survivor:
        print(f"  the survivor said: {survivor['fit_raised']['error'][:200]}")
    print(f"RESULT {launcher}: kill -> first resumed step {out['total']:.3f} s", flush=True)
    return out


def median_phases(results: list[dict[str, float | None]]) -> dict[str, float | None]:
    out = {}
    for name in PHASES:
        values = [r[name] for r in results if r[name] is not None]
        out[name] = C.median(values) if values else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launcher", default="all",
                        choices=("meshfit", "meshfit-standby", "meshfit-preload", "torchrun", "all"))
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one trial each")
    args = parser.parse_args()
    trials = 1 if args.quick else args.trials
    launchers = (("meshfit", "meshfit-standby", "meshfit-preload", "torchrun") if args.launcher == "all"
                 else (args.launcher,))
    for launcher in launchers:
        results = [trial(launcher, steps=30, timeout=180) for _ in range(trials)]
        print(f"\n{launcher}: medians of {trials} trial(s), seconds after the kill (target: total <= 5 s "
              "under meshfit launch, survivor detection <= 1 s)")
        for name, value in median_phases(results).items():
            print(f"  {name:30s} {'-' if value is None else f'{value:7.3f}'}")


if __name__ == "__main__":
    main()
