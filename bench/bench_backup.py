"""What fault tolerance costs: BackupAndRestore's step-time overhead, and kill-to-resume time.

Issue targets:
  A. step time with ``BackupAndRestore(save_freq=30)`` / without <= 1.02, its digest included (seed CNN, 2 workers);
  B. time from a worker's SIGKILL to the first resumed step under ``meshfit launch``.

Part A starts 2 workers of ``bench/_mw_worker.py --mode backup`` under ``TF_CONFIG`` (as
bench_multiworker.py does). Each round runs three blocks of ``--steps`` (default 60) steps of ``fit``
on the global batch 128, separated by barriers: ``plain`` (no callback), ``sync``
(``BackupAndRestore(dir, save_freq=30, delete_checkpoint=True)``) and ``async`` (the same with
``async_save=True``), each with a fresh backup dir per block; a block includes its saves, the wait
for the last async save and the deletion of the backup dir when fit ends. Reported: median per-round
ratios sync/plain and async/plain of rank 0's wall time per step.

Part B runs ``meshfit launch --workers 2 --max-restarts 1 bench/_resume_worker.py``: the job trains
with ``BackupAndRestore(save_freq=10)``; in round 0 worker 1 writes ``time.time()`` and SIGKILLs itself
before step 25; round 1 resumes from the backup of step 20. Reported: seconds from the kill to the
first ``on_train_batch_end`` of round 1 (the chief's), broken down with the launcher's messages (time
stamped as they arrive here) and each worker's own event log. A "slow-step" trial repeats it with a
0.3 s sleep before every step, standing in for a model whose step is longer than the launcher's
~0.1 s failure detection (see the README for what changes).

Part C accounts the cost of part A's asynchronous backup inside the training processes, free of the
spread between blocks (several per cent, as large as the effect): ``--runs`` times, ``meshfit launch
--workers 2 bench/_cnn_fit.py --threads 1 --batch 128 --steps 60 --epochs 3 --backup-freq 30
--step-times`` (the first epoch a warm-up); from the chief: 1 + (the median saving step's time after
its step clock's batch end, beyond a quiet step's, + the writer threads' CPU time per save, averaged
over the two ranks, whose writers share the two cores) / (30 x the median quiet step). This charges
every CPU-second of the writers against training, as if the cores had no idle time to absorb it.

Run:  .venv/bin/python bench/bench_backup.py [--quick] [--part A|B|C|AB|ABC] [--rounds R] [--steps S] [--trials T] [--runs N]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

SAVE_FREQ = 30
SLOW_STEP_DELAY = 0.3


# ---- part A ------------------------------------------------------------------------------------
def part_a(rounds: int, steps: int, extra: list[str], timeout: float) -> None:
    print(f"\n== part A: BackupAndRestore(save_freq={SAVE_FREQ}) overhead, 2 workers, global batch 128; "
          f"{rounds} rounds x {steps} steps per variant after 1 warm-up round ==", flush=True)
    if steps % SAVE_FREQ:
        print(f"note: {steps} steps is not a multiple of save_freq={SAVE_FREQ}: blocks differ in save count")
    result = C.run_mw_workers("backup", rounds, steps, ["--save-freq", str(SAVE_FREQ), *extra], timeout)
    r0, r1 = result["ranks"][0], result["ranks"][1]
    wall = r0["times"]["wall"]
    cpu_sum = {name: [a + b for a, b in zip(r0["times"]["cpu"][name], r1["times"]["cpu"][name], strict=True)]
               for name in wall}
    C.print_rounds("wall time, rank 0", wall, ratio_of=("sync", "plain", "async", "plain"))
    C.print_rounds("CPU time, rank 0 + rank 1", cpu_sum, ratio_of=("sync", "plain", "async", "plain"))
    saves = steps // SAVE_FREQ
    print(f"{saves} save(s) per block; extra wall time per save (median over rounds): "
          + ", ".join(f"{v} {C.median([(a - b) * steps / max(saves, 1) for a, b in zip(wall[v], wall['plain'], strict=True)]):.0f} ms"
                      for v in ("sync", "async")))
    same = all(d == 0.0 for r in (r0, r1) for d in r["weight_diff_vs_plain"].values())
    print(f"same work check (max weight difference vs plain): rank 0 {r0['weight_diff_vs_plain']}, "
          f"rank 1 {r1['weight_diff_vs_plain']}: {'PASS (bitwise equal)' if same else 'FAIL: the variants trained on different data'}")
    print(f"backups restored by mistake: {r0['restored'] + r1['restored'] or 'none'}; backup dirs left after "
          f"fit (delete_checkpoint=True): {r0['leftover_backup_dirs'] or 'none'}")
    for variant in ("sync", "async"):
        C.summarize({"wall": wall, "cpu": cpu_sum}, variant, "plain", C.TARGET_BACKUP,
                    f"BackupAndRestore {variant}/plain")


# ---- part B ------------------------------------------------------------------------------------
def _kill_workers(events_dir: str) -> None:
    """SIGKILL the process group of every worker the event logs name (each leads its own session)."""
    pids = set()
    for name in os.listdir(events_dir) if os.path.isdir(events_dir) else []:
        if name.startswith("events-"):
            for event in _read_events(os.path.join(events_dir, name)):
                if "pid" in event:
                    pids.add(int(event["pid"]))
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"_resume_worker.py" not in f.read():
                    continue  # gone, and the pid reused by something else
            os.killpg(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def _read_events(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _events(events_dir: str, rank: int, round_: int) -> dict[str, dict]:
    path = os.path.join(events_dir, f"events-{rank}-{round_}.jsonl")
    return {e["event"]: e for e in _read_events(path)} if os.path.exists(path) else {}


def resume_trial(trial: int, steps: int, timeout: float, step_delay: float = 0.0) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="meshfit-bench-resume-") as tmp:
        events_dir, backup_dir = os.path.join(tmp, "events"), os.path.join(tmp, "backup")
        os.makedirs(events_dir)
        argv = [C.python(), "-m", "meshfit._cli", "launch", "--workers", "2", "--max-restarts", "1",
                os.path.join(C.BENCH, "_resume_worker.py"), "--events", events_dir, "--backup-dir", backup_dir,
                "--steps", str(steps), "--save-freq", "10", "--kill-rank", "1", "--kill-at", "25"]
        if step_delay:
            argv += ["--step-delay", str(step_delay)]
        env = C.clean_env()
        label = f"slow-step trial {trial} (each step sleeps {step_delay} s first)" if step_delay else f"trial {trial}"
        print(f"\n{label}: command: " + C.command_line(argv, env, ("OMP_NUM_THREADS",)), flush=True)
        launcher = C.Child(argv, env, "launcher")
        try:
            deadline = time.monotonic() + timeout
            while launcher.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if launcher.proc.poll() is None:
                print(f"launcher still running after {timeout:.0f} s: stopping it")
                os.kill(launcher.proc.pid, signal.SIGTERM)  # it forwards SIGTERM to its workers
                try:
                    launcher.proc.wait(timeout=15)
                except Exception:  # noqa: BLE001 - killed below either way
                    pass
        finally:
            launcher.kill()
            _kill_workers(events_dir)
        code = launcher.proc.returncode
        if code != 0:
            raise RuntimeError(f"meshfit launch exited with {code}; output:\n{launcher.output}")
        return _timeline(events_dir, launcher)


def _timeline(events_dir: str, launcher: C.Child) -> dict[str, float]:
    with open(os.path.join(events_dir, "kill-time")) as f:
        t_kill = float(f.read())

    def launcher_line(text: str) -> float | None:
        return next((t for t, line in launcher.lines if text in line and line.startswith("meshfit launch:")),
                    None)

    t_detect = launcher_line("worker 1 exited with code")
    t_round1 = launcher_line("round 1: starting")
    force_killed = launcher_line("still running")
    survivor = _events(events_dir, 0, 0)
    r1 = {rank: _events(events_dir, rank, 1) for rank in (0, 1)}
    chief_first = r1[0]["first_batch_end"]["t"]

    print("timeline, seconds after worker 1's SIGKILL (t=0):")
    print(f"  {t_detect - t_kill:8.3f}  launcher reports worker 1 exited (restarting the group)")
    if "fit_raised" in survivor:
        print(f"  {survivor['fit_raised']['t'] - t_kill:8.3f}  round-0 worker 0: fit raised "
              f"{survivor['fit_raised']['error'][:160]}")
    else:
        print("            round-0 worker 0: no 'fit raised' event: it ended without unwinding, i.e. by the "
              "launcher's SIGTERM (default action) or SIGKILL")
    if force_killed is not None:
        print(f"  {force_killed - t_kill:8.3f}  launcher: worker 0 ignored SIGTERM for 10 s: SIGKILL")
    print(f"  {t_round1 - t_kill:8.3f}  launcher starts round 1")
    names = ["script_start", "imports_done", "strategy_ready", "model_ready", "fit_called",
             "restore_begin", "restore_end", "first_batch_end"]
    for name in names:
        cells = [f"rank {rank} {r1[rank][name]['t'] - t_kill:8.3f}" if name in r1[rank] else f"rank {rank}        -"
                 for rank in (0, 1)]
        print(f"  round 1 {name:16s} " + "   ".join(cells))
    iteration = r1[0]["first_batch_end"].get("iterations")
    restored_at = r1[0]["restore_end"].get("iterations")
    print(f"  round 1 restored {r1[0]['restore_end'].get('restored_from')} (iteration {restored_at}); "
          f"first resumed step = iteration {iteration}")

    def latest(name: str) -> float:
        return max(r1[rank][name]["t"] for rank in (0, 1))

    def earliest(name: str) -> float:
        return min(r1[rank][name]["t"] for rank in (0, 1))

    phases = {
        "launcher detection (kill -> exit seen)": t_detect - t_kill,
        "teardown of the round-0 group": t_round1 - t_detect,
        "spawn + interpreter start": earliest("script_start") - t_round1,
        "imports (torch, meshfit)": latest("imports_done") - earliest("script_start"),
        "rendezvous (MultiWorkerMirroredStrategy())": latest("strategy_ready") - latest("imports_done"),
        "data + model + compile": latest("model_ready") - latest("strategy_ready"),
        "fit setup (data handler, build incl. first torch.optim, DDP)": latest("restore_begin") - latest("fit_called"),
        "restore (BackupAndRestore.on_train_begin)": latest("restore_end") - latest("restore_begin"),
        "first resumed step": chief_first - latest("restore_end"),
    }
    total = chief_first - t_kill
    print("breakdown (s; 'latest' rank gates each phase):")
    for name, value in phases.items():
        print(f"  {name:60s} {value:7.3f}")
    print(f"  {'(sum of phases; rest is gaps between them)':60s} {sum(phases.values()):7.3f}")
    print(f"RESULT kill -> first resumed step: {total:.3f} s")
    return {"total": total, **phases}


def part_b(trials: int, slow_trials: int, steps: int, timeout: float) -> None:
    print(f"\n== part B: kill -> first resumed step under meshfit launch ({trials} trial(s)"
          f"{f' + {slow_trials} slow-step trial(s)' if slow_trials else ''}) ==", flush=True)
    results = [resume_trial(t, steps, timeout) for t in range(trials)]
    if trials > 1:
        print("\nmedians over trials:")
        for key in results[0]:
            print(f"  {key:60s} {C.median([r[key] for r in results]):7.3f}")
        totals = [r["total"] for r in results]
        slow = sum(r["teardown of the round-0 group"] > 1.0 for r in results)
        print(f"RESULT kill -> first resumed step, median of {trials}: {C.median(totals):.3f} s "
              f"(trials {C.spread(totals)} s; {slow} of {trials} took the slow teardown path, > 1 s)")
    if slow_trials:
        print(f"\nslow-step scenario: every step first sleeps {SLOW_STEP_DELAY} s (a model whose step outlasts the "
              "launcher's ~0.1 s detection), so the launcher's SIGTERM reaches the survivor while fit's "
              "SIGTERM (preemption) handler is installed.")
        slow = [resume_trial(t, steps, timeout, step_delay=SLOW_STEP_DELAY) for t in range(slow_trials)]
        print(f"RESULT slow-step scenario: kill -> first resumed step {C.median([r['total'] for r in slow]):.3f} s "
              f"(teardown {C.median([r['teardown of the round-0 group'] for r in slow]):.3f} s)")


# ---- part C ------------------------------------------------------------------------------------
def part_c(runs: int, timeout: float) -> None:
    import subprocess

    print(f"\n== part C: BackupAndRestore(save_freq={SAVE_FREQ}) accounted inside 2 launched workers, seed CNN, "
          f"global batch 128; {runs} run(s) of 3 x 60 steps (epoch 1 a warm-up) ==", flush=True)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_cnn_fit.py")
    accounted: list[float] = []
    for run in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            argv = [C.python(), "-m", "meshfit._cli", "launch", "--workers", "2", script, "--threads", "1",
                    "--batch", "128", "--steps", "60", "--epochs", "3", "--backup-freq", str(SAVE_FREQ),
                    "--step-times", "--backup-dir", os.path.join(tmp, "backup"), "--out", out]
            if run == 0:
                print("command:", " ".join(argv), flush=True)
            done = subprocess.run(argv, timeout=timeout, env=C.clean_env(), capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"meshfit launch exited with {done.returncode}; output:\n{done.stdout}{done.stderr}")
            result = C.read_json(out)
            writers = [result["writer_cpu_ms"], C.read_json(f"{out}.task1")["writer_cpu_ms"]]
        result["writer_cpu_ms"] = sum(writers) / len(writers)  # the two writers share the two cores
        cost = C.backup_cost(result, SAVE_FREQ)
        accounted.append(cost.ratio)
        print(f"run {run + 1}: {result['ms_per_step']:.1f} ms/step; a save's extra time on the training thread "
              f"{cost.save_extra_ms:.1f} ms, the writer threads' CPU per save {writers[0] / cost.saves:.1f} (chief) "
              f"and {writers[1] / cost.saves:.1f} ms; accounted {cost.ratio:.4f}", flush=True)
    ratio = C.median(accounted)
    print(f"RESULT BackupAndRestore async, accounted in the workers: median {ratio:.4f} (runs "
          f"{min(accounted):.4f}..{max(accounted):.4f}); target <= {C.TARGET_BACKUP}: "
          f"{C.verdict(ratio, C.TARGET_BACKUP)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--part", default="AB", choices=("A", "B", "C", "AB", "AC", "ABC"))
    parser.add_argument("--rounds", type=int, default=None, help="part A measured rounds (default 4; quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="part A steps per block (default 60; quick 30)")
    parser.add_argument("--trials", type=int, default=None, help="part B kill/resume trials (default 3; quick 1)")
    parser.add_argument("--slow-trials", type=int, default=None,
                        help=f"part B trials with a {SLOW_STEP_DELAY} s sleep before every step (default 1; quick 0)")
    parser.add_argument("--runs", type=int, default=None, help="part C launched runs (default 5; quick 1)")
    parser.add_argument("--tune-malloc", action="store_true", help="mallopt-tune glibc in the workers (part A)")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 4)
    steps = args.steps or (30 if args.quick else 60)
    trials = args.trials or (1 if args.quick else 3)
    slow_trials = args.slow_trials if args.slow_trials is not None else (0 if args.quick else 1)
    extra = ["--tune-malloc"] if args.tune_malloc else []
    if "A" in args.part:
        part_a(rounds, steps, extra, timeout=120 if args.quick else 400)
    if "B" in args.part:
        part_b(trials, slow_trials, steps=30, timeout=120)
    if "C" in args.part:
        part_c(args.runs or (1 if args.quick else 5), timeout=300)


if __name__ == "__main__":
    main()
