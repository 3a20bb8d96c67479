"""``make bench``: every performance comparison of the project, in default processes, as ONE table of ratios.

Each measured thing is a small script started the way a user starts it -- ``python bench/_cnn_fit.py``,
``meshfit launch --workers 2 bench/_cnn_fit.py``, ``python -c "import torch"`` -- in a default
environment: nothing tunes glibc's malloc, no thread variables are set (the scripts call
``torch.set_num_threads`` as a user does). Only the "tuned" column's hand-written loop gets
``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` in its own environment. Every round starts one
fresh process per variant, the order reversed every other round; each comparison is the median of
its per-round ratios, so a slow period hits both sides of a round.

The scripts (each writes one JSON object; the first epoch of every timed run is a warm-up):

- ``_cnn_fit.py``: the seed CNN (batch 64, SGD 0.01, accuracy metric) trained by ``fit``; with
  ``--policy``, ``--backup-freq``, ``--step-times``, ``--first-step``; under ``meshfit launch`` for 2 workers.
- ``_cnn_hand.py``: the same model, data order and init in a hand-written torch loop (same checksum).
- ``_mlp_fit.py`` / ``_mlp_keras.py``: keras.io's MLP + Adam, batch 32, in meshfit and in TF Keras
  (``.venv-tf``, made by ``bench/tf_venv.sh``; the rows are skipped without it), also over ~50,000
  examples, where Adam's state goes denormal (meshfit flushes denormals in ``fit``, as TF does; the
  ``MESHFIT_FLUSH_DENORMALS=0`` runs show the difference).
- ``bench_recovery.py``: one ``kill -9`` → first resumed step trial a round, under ``meshfit launch``
  and ``meshfit launch --standby``,
  timed by phase.
- ``_imports.py``: ``import torch`` and ``import meshfit``, each in its own fresh ``python -c``, in
  interleaved pairs (``--import-pairs``, default 5 a round); the figure is the median per-pair ratio.

Run:  .venv/bin/python bench/bench_all.py [--rounds 3] [--steps 40] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import bench_recovery  # noqa: E402

TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
TF_PYTHON = os.path.join(C.ROOT, ".venv-tf", "bin", "python")
_CLUSTER_AND_TUNING = ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                       "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID", "OMP_NUM_THREADS",
                       "MKL_NUM_THREADS", "MESHFIT_RESTART_COUNT", *TUNED_MALLOC)


def user_env(**extra: str) -> dict[str, str]:
    """The environment a user's shell gives ``python script.py``: ours minus cluster/tuning variables."""
    env = {k: v for k, v in os.environ.items() if k not in _CLUSTER_AND_TUNING}
    env["PYTHONPATH"] = C.ROOT + os.pathsep + env.get("PYTHONPATH", "")  # this checkout's meshfit
    env.update(extra)
    return env


def variants(args: argparse.Namespace, tmp: str) -> dict[str, tuple[list[str], dict[str, str]]]:
    """``{name: (argv without --out, env)}`` of every process a round starts."""
    py, b = C.python(), lambda name: os.path.join(C.BENCH, name)
    timed = ["--steps", str(args.steps), "--epochs", str(args.epochs)]
    launch = [py, "-m", "meshfit._cli", "launch", "--workers", "2", "--threads", "1"]
    out: dict[str, tuple[list[str], dict[str, str]]] = {}
    for threads in (1, 2):
        t = ["--threads", str(threads)]
        out[f"fit_{threads}t"] = ([py, b("_cnn_fit.py"), *t, *timed], user_env())
        out[f"hand_{threads}t"] = ([py, b("_cnn_hand.py"), *t, *timed], user_env())
        out[f"hand_tuned_{threads}t"] = ([py, b("_cnn_hand.py"), *t, *timed], user_env(**TUNED_MALLOC))
    out["fit_bf16_1t"] = ([py, b("_cnn_fit.py"), "--policy", "mixed_bfloat16", *timed], user_env())
    out["mlp_meshfit"] = ([py, b("_mlp_fit.py"), "--data", args.mlp_data, "--steps", str(args.mlp_steps)],
                          user_env())
    if os.path.exists(TF_PYTHON):
        out["mlp_keras"] = ([TF_PYTHON, b("_mlp_keras.py"), "--data", args.mlp_data,
                             "--steps", str(args.mlp_steps)], user_env())
    # keras.io's MLP over ~50,000 examples (3 epochs of --mlp50k-steps batches of 32): Adam's moments
    # of always-blank pixels decay into denormals after some hundred steps; TF flushes them, so does
    # meshfit inside fit (MESHFIT_FLUSH_DENORMALS=0 turns it off: the "off" runs).
    mlp50k = [b("_mlp_fit.py"), "--data", args.mlp_data, "--steps", str(args.mlp50k_steps)]
    out["mlp50k_meshfit"] = ([py, *mlp50k], user_env())
    out["mlp50k_meshfit_off"] = ([py, *mlp50k], user_env(MESHFIT_FLUSH_DENORMALS="0"))
    if os.path.exists(TF_PYTHON):
        out["mlp50k_keras"] = ([TF_PYTHON, b("_mlp_keras.py"), "--data", args.mlp_data,
                                "--steps", str(args.mlp50k_steps)], user_env())
    out["fit_1t_flush_off"] = ([py, b("_cnn_fit.py"), "--threads", "1", *timed],
                               user_env(MESHFIT_FLUSH_DENORMALS="0"))
    out["scale_1p2t"] = ([py, b("_cnn_fit.py"), "--threads", "2", "--batch", "128", *timed], user_env())
    out["scale_2w1t"] = ([*launch, b("_cnn_fit.py"), "--threads", "1", "--batch", "128", *timed], user_env())
    out["scale_2w1t_bf16"] = ([*launch, b("_cnn_fit.py"), "--threads", "1", "--batch", "128", "--compression",
                               "bfloat16", *timed], user_env())
    # the machine's ceiling for that ratio: two independent 1-thread processes (batch 64 each), no communication
    out["scale_2x1t_alone"] = ([py, b("_cnn_fit.py"), "--threads", "1", "--batch", "64", *timed], user_env())
    backup_timed = ["--step-times", "--threads", "2", "--steps", str(args.backup_steps), "--epochs", "3"]
    out["backup_none"] = ([py, b("_cnn_fit.py"), *backup_timed], user_env())
    for kind, extra in (("default", []), ("sync", ["--sync-save"])):  # default: asynchronous saves
        out[f"backup_{kind}"] = ([py, b("_cnn_fit.py"), *backup_timed, "--backup-freq", str(args.save_freq),
                                  "--backup-dir", os.path.join(tmp, f"backup-{kind}"), *extra], user_env())
    out["imports"] = ([py, b("_imports.py"), "--pairs", str(args.import_pairs)], user_env())
    first = ["--steps", "1", "--epochs", "1", "--first-step"]
    out["first_1p"] = ([py, b("_cnn_fit.py"), *first], user_env())
    out["first_2w"] = ([*launch, b("_cnn_fit.py"), *first], user_env())
    return out


TOGETHER = {"scale_2x1t_alone": 2}  # variants started as that many copies at once


def run_one(name: str, argv: list[str], env: dict[str, str], tmp: str, timeout: float) -> dict:
    """Start one default process (its own session, killed with its group afterwards); its JSON + spawn time.

    A variant in `TOGETHER` starts that many copies at once; its ``ms_per_step`` is the slowest copy's.
    """
    outs = [os.path.join(tmp, f"{name}-{i}.json") for i in range(TOGETHER.get(name, 1))]
    for out in outs:
        if os.path.exists(out):
            os.remove(out)
    spawned = time.time()
    C.run_children([(f"{name}-{i}", [*argv, "--out", out], env)
                    for i, out in enumerate(outs)], timeout=timeout)
    copies = [C.read_json(out) for out in outs]
    result = max(copies, key=lambda r: r.get("ms_per_step", 0.0))
    result["spawned"], result["process_s"] = spawned, time.time() - spawned
    return result


def backup_figures(step_ms: list[float], steps_per_epoch: int, save_freq: int) -> tuple[float, float, float]:
    """After the warm-up epoch: (median step ms on saving steps minus on the others, mean step ms,
    mean step ms ÷ mean of the quiet steps of the same run).

    ``step_ms[i]`` is the duration of step ``i + 1`` (1-based), from its start to the next step's
    start: a save made at the end of step ``k`` is inside step ``k``. An epoch's last step also holds
    the epoch-end callbacks (the same in every run); the run's last step has no next start.
    The quiet steps are the second half of each save cycle (``save_freq // 2 <= k % save_freq``),
    when a background write has long finished: the in-run ratio charges a save with everything it
    costs (the saving step and any step slowed while it writes) without comparing two processes.
    """
    durations = {i + 1: ms for i, ms in enumerate(step_ms) if i + 1 > steps_per_epoch}
    saving = [ms for step, ms in durations.items() if step % save_freq == 0]
    other = [ms for step, ms in durations.items() if step % save_freq != 0]
    quiet = [ms for step, ms in durations.items() if step % save_freq >= save_freq // 2]
    mean = statistics.fmean(durations.values())
    return statistics.median(saving) - statistics.median(other), mean, mean / statistics.fmean(quiet)


def collect(runs: list[dict[str, dict]], args: argparse.Namespace) -> dict[str, list[float]]:
    """Per-round figures of every row."""
    rows: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        rows.setdefault(key, []).append(value)

    for r in runs:
        for t in (1, 2):
            add(f"fit/hand {t}t", r[f"fit_{t}t"]["ms_per_step"] / r[f"hand_{t}t"]["ms_per_step"])
            add(f"fit/tuned {t}t", r[f"fit_{t}t"]["ms_per_step"] / r[f"hand_tuned_{t}t"]["ms_per_step"])
            add(f"cpu fit/hand {t}t", r[f"fit_{t}t"]["cpu_ms_per_step"] / r[f"hand_{t}t"]["cpu_ms_per_step"])
            add(f"cpu fit/tuned {t}t",
                r[f"fit_{t}t"]["cpu_ms_per_step"] / r[f"hand_tuned_{t}t"]["cpu_ms_per_step"])
            for v in ("fit", "hand", "hand_tuned"):
                add(f"ms {v}_{t}t", r[f"{v}_{t}t"]["ms_per_step"])
                add(f"faults {v}_{t}t", r[f"{v}_{t}t"]["faults_per_step"])
        add("bf16/fp32", r["fit_bf16_1t"]["ms_per_step"] / r["fit_1t"]["ms_per_step"])
        add("ms fit_bf16_1t", r["fit_bf16_1t"]["ms_per_step"])
        if "mlp_keras" in r:
            add("mlp meshfit/keras", r["mlp_meshfit"]["ms_per_step"] / r["mlp_keras"]["ms_per_step"])
            add("cpu mlp meshfit/keras", r["mlp_meshfit"]["cpu_ms_per_step"] / r["mlp_keras"]["cpu_ms_per_step"])
            add("ms mlp_keras", r["mlp_keras"]["ms_per_step"])
        add("ms mlp_meshfit", r["mlp_meshfit"]["ms_per_step"])
        if "mlp50k_keras" in r:
            add("mlp50k meshfit/keras", r["mlp50k_meshfit"]["ms_per_step"] / r["mlp50k_keras"]["ms_per_step"])
            add("ms mlp50k_keras", r["mlp50k_keras"]["ms_per_step"])
        for v in ("mlp50k_meshfit", "mlp50k_meshfit_off", "fit_1t_flush_off"):
            add(f"ms {v}", r[v]["ms_per_step"])
        add("mlp50k flush/off", r["mlp50k_meshfit"]["ms_per_step"] / r["mlp50k_meshfit_off"]["ms_per_step"])
        add("cnn flush/off", r["fit_1t"]["ms_per_step"] / r["fit_1t_flush_off"]["ms_per_step"])
        # throughput at the same global batch = inverse step time
        add("2w/1p2t", r["scale_1p2t"]["ms_per_step"] / r["scale_2w1t"]["ms_per_step"])
        add("2w bf16/1p2t", r["scale_1p2t"]["ms_per_step"] / r["scale_2w1t_bf16"]["ms_per_step"])
        add("2x1t alone/1p2t", r["scale_1p2t"]["ms_per_step"] / r["scale_2x1t_alone"]["ms_per_step"])
        add("ms scale_1p2t", r["scale_1p2t"]["ms_per_step"])
        add("ms scale_2w1t", r["scale_2w1t"]["ms_per_step"])
        add("ms scale_2x1t_alone", r["scale_2x1t_alone"]["ms_per_step"])
        _, plain_mean, plain_in_run = backup_figures(r["backup_none"]["step_ms"], args.backup_steps, args.save_freq)
        add("backup none in-run", plain_in_run)
        for kind in ("default", "sync"):
            extra, mean, in_run = backup_figures(r[f"backup_{kind}"]["step_ms"], args.backup_steps, args.save_freq)
            add(f"backup {kind} saving step +ms", extra)
            add(f"backup {kind} mean", mean / plain_mean)
            add(f"backup {kind} in-run", in_run)
        pairs = zip(r["imports"]["meshfit_s"], r["imports"]["torch_s"], strict=True)
        add("import meshfit/torch", statistics.median(m / t for m, t in pairs))
        add("import torch s", statistics.median(r["imports"]["torch_s"]))
        for key, label in (("recovery", "recovery"), ("recovery_standby", "standby recovery"),
                           ("recovery_preload", "preload recovery")):
            for phase, value in r.get(key, {}).items():
                if value is not None:
                    add(f"{label} {phase}", value)
        add("first step 1p s", r["first_1p"]["first_step_end"] - r["first_1p"]["spawned"])
        add("first step 2w s", r["first_2w"]["first_step_end"] - r["first_2w"]["spawned"])
    return rows


def table(rows: dict[str, list[float]], cores: int, load: tuple[float, float], save_freq: int,
          mlp50k_steps: int) -> str:
    m = {k: statistics.median(v) for k, v in rows.items()}

    def rng(key: str, fmt: str = ".3f") -> str:
        return f"{min(rows[key]):{fmt}}–{max(rows[key]):{fmt}}"

    lines = [f"machine: {cores} cores (os.cpu_count), load average {load[0]:.1f} at start, {load[1]:.1f} at end"
             + ("  ** MEASURED UNDER LOAD: figures are noisy **" if max(load) > cores else ""),
             f"{len(next(iter(rows.values())))} round(s); each ratio is the median of per-round ratios "
             "(range in brackets)", "",
             "| comparison (default processes) | ratio / figure | tuned² | target | detail (medians) |",
             "|---|---|---|---|---|"]
    for t in (1, 2):
        lines.append(
            f"| seed CNN `fit` ÷ hand-written loop, batch 64, {t} thread{'s' if t > 1 else ''} | "
            f"{m[f'fit/hand {t}t']:.3f} [{rng(f'fit/hand {t}t')}] | {m[f'fit/tuned {t}t']:.3f} "
            f"[{rng(f'fit/tuned {t}t')}] | ≤ 0.75; tuned ≤ 1.03 | fit {m[f'ms fit_{t}t']:.1f}, hand "
            f"{m[f'ms hand_{t}t']:.1f}, tuned hand {m[f'ms hand_tuned_{t}t']:.1f} ms/step; CPU-time ratios "
            f"{m[f'cpu fit/hand {t}t']:.3f} / {m[f'cpu fit/tuned {t}t']:.3f} |")
    if "mlp meshfit/keras" in rows:
        lines.append(f"| keras.io MLP + Adam, batch 32, 1 thread: meshfit ÷ TF Keras `fit` | "
                     f"{m['mlp meshfit/keras']:.3f} [{rng('mlp meshfit/keras')}] | – | ≤ 1.0 | meshfit "
                     f"{m['ms mlp_meshfit']:.2f}, TF {m['ms mlp_keras']:.2f} ms/step; CPU-time ratio "
                     f"{m['cpu mlp meshfit/keras']:.3f} |")
    else:
        lines.append(f"| keras.io MLP + Adam, batch 32, 1 thread: meshfit ÷ TF Keras `fit` | not run (no "
                     f"{os.path.relpath(TF_PYTHON, C.ROOT)}: bench/tf_venv.sh) | – | ≤ 1.0 | meshfit "
                     f"{m['ms mlp_meshfit']:.2f} ms/step |")
    examples = 3 * mlp50k_steps * 32
    if "mlp50k meshfit/keras" in rows:
        lines.append(f"| the same MLP over {examples:,} examples (Adam's state goes denormal): meshfit ÷ TF Keras | "
                     f"{m['mlp50k meshfit/keras']:.3f} [{rng('mlp50k meshfit/keras')}] | – | ≤ 0.8 | meshfit "
                     f"{m['ms mlp50k_meshfit']:.2f}, TF {m['ms mlp50k_keras']:.2f} ms/step |")
    else:
        lines.append(f"| the same MLP over {examples:,} examples (Adam's state goes denormal): meshfit ÷ TF Keras | "
                     f"not run (no {os.path.relpath(TF_PYTHON, C.ROOT)}: bench/tf_venv.sh) | – | ≤ 0.8 | meshfit "
                     f"{m['ms mlp50k_meshfit']:.2f} ms/step |")
    lines.append(f"| denormals flushed in `fit` ÷ not (`MESHFIT_FLUSH_DENORMALS=0`): that MLP / seed CNN 1 thread | "
                 f"{m['mlp50k flush/off']:.3f} / {m['cnn flush/off']:.3f} [{rng('mlp50k flush/off')} / "
                 f"{rng('cnn flush/off')}] | – | reported | MLP {m['ms mlp50k_meshfit']:.2f} / "
                 f"{m['ms mlp50k_meshfit_off']:.2f}, CNN {m['ms fit_1t']:.1f} / {m['ms fit_1t_flush_off']:.1f} ms/step |")
    lines += [
        f"| throughput, 2 workers × 1 thread ÷ 1 process × 2 threads, seed CNN, global batch 128 | "
        f"{m['2w/1p2t']:.3f} [{rng('2w/1p2t')}] | – | ≥ 0.9 | 1 process × 2 threads {m['ms scale_1p2t']:.1f}, "
        f"2 workers {m['ms scale_2w1t']:.1f} ms/step; this machine's ceiling, two independent 1-thread "
        f"processes of batch 64 without communication: {m['2x1t alone/1p2t']:.3f} "
        f"({m['ms scale_2x1t_alone']:.1f} ms/step) |",
        f"| the same, `CommunicationOptions(gradient_compression=\"bfloat16\")` (weights within bf16 rounding, "
        f"not bitwise) | {m['2w bf16/1p2t']:.3f} [{rng('2w bf16/1p2t')}] | – | ≥ 0.9 | |",
        f"| `BackupAndRestore(save_freq={save_freq})`, default arguments (asynchronous saves): mean step ÷ "
        f"without backups, same round | {m['backup default mean']:.3f} [{rng('backup default mean')}] | – | ≤ 1.02 | "
        f"`async_save=False` (synchronous): {m['backup sync mean']:.3f} [{rng('backup sync mean')}]; two processes "
        "of one round, seed CNN, batch 64, 2 threads |",
        f"| `BackupAndRestore(save_freq={save_freq})` added ms on a saving step, default / sync | "
        f"{m['backup default saving step +ms']:.1f} / {m['backup sync saving step +ms']:.1f} ms "
        f"[{rng('backup default saving step +ms', '.1f')} / {rng('backup sync saving step +ms', '.1f')}] | – | "
        "≤ 5 ms | median of the saving steps (a step lasts from its start to the next one's, so it holds the "
        "save) minus median of the other steps, same run |",
        f"| `BackupAndRestore(save_freq={save_freq})` mean step ÷ mean of the same run's quiet steps, default / "
        f"sync | {m['backup default in-run']:.3f} / {m['backup sync in-run']:.3f} [{rng('backup default in-run')} / "
        f"{rng('backup sync in-run')}] | – | ≤ 1.01 | quiet: the second half of each save cycle; the same "
        f"figure without backups {m['backup none in-run']:.3f} |",
        f"| `import meshfit` ÷ `import torch` | {m['import meshfit/torch']:.3f} [{rng('import meshfit/torch')}] "
        f"| – | ≤ 1.1 | import torch {m['import torch s']:.2f} s |",
        f"| process start → end of first step, 1 process | {m['first step 1p s']:.2f} s "
        f"[{rng('first step 1p s', '.2f')}] | – | ≤ 4 s | |",
        f"| process start → end of first step, 2 workers under `meshfit launch` | {m['first step 2w s']:.2f} s "
        f"[{rng('first step 2w s', '.2f')}] | – | ≤ 6 s | |",
    ]
    phases = [p for p in bench_recovery.PHASES[2:-1] if f"recovery {p}" in rows]
    survivor = rows.get("recovery detection by the survivor")
    lines.append(
        f"| `kill -9` of 1 of 2 workers → first resumed step, `meshfit launch --max-restarts 1` | "
        f"{m['recovery total']:.2f} s [{rng('recovery total', '.2f')}] | – | ≤ 5 s | the launcher saw the exit "
        f"after {m.get('recovery detection by the launcher', float('nan')):.2f} s; then "
        + ", ".join(f"{p} {m[f'recovery {p}']:.2f}" for p in phases) + " s (medians; bench/bench_recovery.py "
        "also runs torchrun's elastic agent) |")
    for variant, what in (("standby", "warm processes: no import on restart"),
                          ("preload", "every task a fork of one preloaded process")):
        if f"{variant} recovery total" in rows:
            lines.append(
                f"| the same with `meshfit launch --{variant}` ({what}) | "
                f"{m[f'{variant} recovery total']:.2f} s [{rng(f'{variant} recovery total', '.2f')}] | – | ≤ 5 s | "
                + ", ".join(f"{p} {m[f'{variant} recovery {p}']:.2f}" for p in phases
                            if f"{variant} recovery {p}" in rows) + " s |")
    lines.append(
        "| `kill -9` → the surviving worker names the dead peer | "
        + (f"{statistics.median(survivor):.2f} s [{min(survivor):.2f}–{max(survivor):.2f}]" if survivor else
           "not seen (the launcher ended the survivor first)")
        + " | – | ≤ 1 s | its liveness connection to the killed process closed; tests/test_liveness.py |")
    for t in (1, 2):
        lines.append(f"| minor page faults per step after warm-up, {t} thread{'s' if t > 1 else ''}: fit / hand "
                     f"/ tuned hand | {m[f'faults fit_{t}t']:.0f} / {m[f'faults hand_{t}t']:.0f} / "
                     f"{m[f'faults hand_tuned_{t}t']:.0f} | – | ≈ 0 for fit | |")
    lines += [f"| `mixed_bfloat16` ÷ `float32` step time, seed CNN `fit`, 1 thread | {m['bf16/fp32']:.3f} "
              f"[{rng('bf16/fp32')}] | – | reported | bf16 {m['ms fit_bf16_1t']:.1f}, fp32 "
              f"{m['ms fit_1t']:.1f} ms/step |", "",
              "² tuned: the hand-written loop's process has MALLOC_MMAP_THRESHOLD_=33554432 "
              "MALLOC_TRIM_THRESHOLD_=1073741824 in its environment; meshfit's never does."]
    return "\n".join(lines)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="steps per epoch of the CNN runs (default 40)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of the CNN runs, the first a warm-up")
    parser.add_argument("--mlp-steps", type=int, default=200)
    parser.add_argument("--mlp50k-steps", type=int, default=521,
                        help="steps per epoch of the MLP runs over ~50,000 examples (3 epochs of batch 32)")
    parser.add_argument("--backup-steps", type=int, default=60, help="steps per epoch of the backup runs")
    parser.add_argument("--save-freq", type=int, default=30)
    parser.add_argument("--import-pairs", type=int, default=5, help="interleaved import timings a round")
    parser.add_argument("--quick", action="store_true", help="1 round of short runs: checks that it works")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per process")
    parser.add_argument("--json", default=None, help="also write every per-round figure here")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.mlp_steps, args.backup_steps, args.mlp50k_steps = 1, 10, 40, 30, 40
    cores = os.cpu_count() or 1
    # As a wheel install does (and `make bytecode`): meshfit's modules compiled once, as torch's are.
    # Without it, an editable install under PYTHONDONTWRITEBYTECODE=1 recompiles them in every process.
    compileall.compile_dir(os.path.join(C.ROOT, "meshfit"), quiet=1)
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="meshfit-bench-all-") as tmp:
        args.mlp_data = os.path.join(tmp, "digits784.npz")
        _write_mlp_data(args.mlp_data)
        plan = variants(args, tmp)
        print(f"bench_all: {len(plan)} processes a round, {args.rounds} round(s); commands:", flush=True)
        for name, (argv, env) in plan.items():
            extra = [k for k in TUNED_MALLOC if k in env]
            copies = f" (x{TOGETHER[name]}, started together)" if name in TOGETHER else ""
            print(f"  {name}{copies}: {C.command_line(argv, env, extra)}", flush=True)
        runs = []
        for r in range(args.rounds):
            names = list(plan) if r % 2 == 0 else list(plan)[::-1]
            results = {}
            for name in names:
                argv, env = plan[name]
                results[name] = run_one(name, argv, env, tmp, args.timeout)
            results["recovery"] = bench_recovery.trial("meshfit", steps=30, timeout=args.timeout)
            results["recovery_standby"] = bench_recovery.trial("meshfit-standby", steps=30, timeout=args.timeout)
            results["recovery_preload"] = bench_recovery.trial("meshfit-preload", steps=30, timeout=args.timeout)
            runs.append(results)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    for t in (1, 2):
        sums = {v: runs[0][f"{v}_{t}t"]["checksum"] for v in ("fit", "hand", "hand_tuned")}
        print(f"same work check, {t} thread(s): weight checksums {sums}")
    rows = collect(runs, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "runs": runs}, f)
    print()
    print(table(rows, cores, (load_start, os.getloadavg()[0]), args.save_freq, args.mlp50k_steps))


def _write_mlp_data(path: str) -> None:
    import numpy as np

    x, y = C.load_train()
    np.savez(path, x=x.reshape(len(x), -1).astype("float32"), y=y.astype("int64"))


if __name__ == "__main__":
    main()
