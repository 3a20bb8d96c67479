"""Goodput of a long job under failures, simulated: useful training time ÷ wall time, against the save interval.

The model (one job, all ranks fail and restart together, as under ``meshfit launch`` or a cluster
manager that restarts the whole group):

* The job trains; after every ``T`` seconds of training it saves a backup, which stalls training for
  ``s`` seconds (the time a step is held up by ``BackupAndRestore``; with ``async_save=True`` the write
  goes on in the background). A backup counts once its stall is over.
* Failures strike at the times of a failure process, in wall time: exponential with mean ``M`` (the
  MTBF of the whole job, not of one machine) or the times read from a trace file. A failure loses
  the training done since the last backup (including a save in progress), and the job restarts: ``R``
  seconds from the failure to the first resumed step (bench/bench_backup.py part B measures it:
  detection, teardown, spawn, imports, rendezvous, restore). A failure during a restart starts the
  restart again.
* Goodput = training time kept ÷ wall time, over a horizon ``H`` (default 54 days). The work done
  after the last backup when the horizon ends is kept (the job simply ends there).

The simulation is event-driven over failures (every save interval between two failures is counted in
one step), so months of wall time take milliseconds. It is compared with two formulas for
exponential failures:

* first order (Young 1974; Daly 2006): waste ≈ s/T + (T/2 + R)/M, minimal at ``T* = sqrt(2 s M)``,
  where goodput ≈ 1 - sqrt(2 s / M) - R / M; it holds when s, R ≪ T ≪ M;
* exact for this model (Daly 2006, eq. 13 with restarts that can fail): each segment of ``T`` seconds
  of training costs on average ``M e^(R/M) (e^((T+s)/M) - 1)`` seconds of wall time.

Calibration: a 16,384-GPU training run reported 419 unexpected interruptions in 54 days (the Llama 3
paper, 2024), i.e. a job MTBF of 54 × 24 / 419 ≈ 3.09 h. ``--save-stall`` and ``--restart`` default
to the latest figures of ``bench/bench_backup.py`` on this machine (bench/README.md: ≈ 70 ms a sync
save of the seed CNN, ≈ 5.2 s from kill -9 to the first resumed step); pass your own.

Usage::

    python bench/goodput.py                                   # M = 3.09 h, s = 0.07 s, R = 5.2 s
    python bench/goodput.py --save-stall 0.07 --restart 5.2 --mtbf-hours 3.09 --seeds 20
    python bench/goodput.py --trace failures.txt              # one failure time (seconds) per line
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

PUBLISHED_INTERRUPTIONS, PUBLISHED_DAYS = 419, 54        # 16k-GPU run: 419 interruptions in 54 days
PUBLISHED_MTBF_HOURS = PUBLISHED_DAYS * 24 / PUBLISHED_INTERRUPTIONS
MEASURED_SAVE_STALL_S = 0.070   # bench/bench_backup.py part A: extra wall time per save (README)
MEASURED_RESTART_S = 5.2        # bench/bench_backup.py part B: kill -9 -> first resumed step (README)
GOAL = 0.98


@dataclass(frozen=True)
class Result:
    """What one simulated job did: wall time, training time kept, failures and saves."""

    wall: float
    useful: float
    failures: int
    saves: int

    @property
    def goodput(self) -> float:
        return self.useful / self.wall


def exponential_failures(mtbf: float, seed: int) -> Iterator[float]:
    """Failure times (s) of a Poisson process with mean time between failures ``mtbf``."""
    rng, t = random.Random(seed), 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf)
        yield t


def simulate(interval: float, save_stall: float, restart: float, failures: Iterator[float],
             horizon: float) -> Result:
    """Replay one job of ``horizon`` wall seconds; see the module docstring for the model."""
    if interval <= 0 or save_stall < 0 or restart < 0 or horizon <= 0:
        raise ValueError(f"Invalid arguments: expected interval > 0, save_stall >= 0, restart >= 0, "
                         f"horizon > 0, received interval={interval}, save_stall={save_stall}, "
                         f"restart={restart}, horizon={horizon}.")
    period = interval + save_stall
    t = useful = 0.0
    n_failures = n_saves = 0
    next_failure = next(failures, math.inf)
    while t < horizon:
        # Training from t (just restarted, or the start): whole save periods until the next failure.
        stop = min(next_failure, horizon)
        periods = math.floor((stop - t) / period)
        t += periods * period
        useful += periods * interval
        n_saves += periods
        if next_failure >= horizon:                         # the job ends before the next failure
            useful += min(horizon - t, interval)          # the unsaved tail is kept at the end
            t = horizon
            break
        # Failure: the work since the last backup is lost; restart, again if a failure strikes meanwhile.
        t = next_failure
        n_failures += 1
        next_failure = next(failures, math.inf)
        while next_failure < t + restart and next_failure < horizon:
            t = next_failure
            n_failures += 1
            next_failure = next(failures, math.inf)
        t = min(t + restart, horizon)
    return Result(wall=t, useful=useful, failures=n_failures, saves=n_saves)


def optimal_interval(save_stall: float, mtbf: float) -> float:
    """Young's first-order optimum ``T* = sqrt(2 s M)``."""
    return math.sqrt(2.0 * save_stall * mtbf)


def goodput_first_order(interval: float, save_stall: float, restart: float, mtbf: float) -> float:
    """``1 - s/T - (T/2 + R)/M``: valid when s, R ≪ T ≪ M."""
    return 1.0 - save_stall / interval - (interval / 2.0 + restart) / mtbf


def goodput_exact(interval: float, save_stall: float, restart: float, mtbf: float) -> float:
    """Expected goodput of this model under exponential failures (long-run limit)."""
    wall_per_segment = mtbf * math.exp(restart / mtbf) * math.expm1((interval + save_stall) / mtbf)
    return interval / wall_per_segment


def read_trace(path: str) -> list[float]:
    """Failure times in seconds from the job start, one per line (``#`` starts a comment)."""
    times = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            try:
                times.append(float(text))
            except ValueError:
                raise ValueError(f"Invalid trace {path}:{number}: expected a time in seconds, "
                                 f"received {text!r}.") from None
    if not times:
        raise ValueError(f"Invalid trace {path}: it lists no failure time.")
    return sorted(times)


def mean_goodput(interval: float, args: argparse.Namespace, trace: Sequence[float] | None) -> tuple[float, float]:
    """Mean and standard error of the goodput over the seeds (one run for a trace)."""
    if trace is not None:
        return simulate(interval, args.save_stall, args.restart, iter(trace), args.horizon).goodput, 0.0
    values = [simulate(interval, args.save_stall, args.restart,
                       exponential_failures(args.mtbf, seed), args.horizon).goodput
              for seed in range(args.seed, args.seed + args.seeds)]
    error = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return statistics.fmean(values), error


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--save-stall", type=float, default=MEASURED_SAVE_STALL_S,
                        help="s: seconds a save stalls training (default: bench_backup.py's %(default)s)")
    parser.add_argument("--restart", type=float, default=MEASURED_RESTART_S,
                        help="R: seconds from a failure to the first resumed step (default %(default)s)")
    parser.add_argument("--mtbf-hours", type=float, default=PUBLISHED_MTBF_HOURS,
                        help="M: job MTBF in hours (default: 419 interruptions in 54 days = %(default).2f)")
    parser.add_argument("--trace", default=None, help="failure times (s) file instead of exponential failures")
    parser.add_argument("--horizon-hours", type=float, default=PUBLISHED_DAYS * 24.0,
                        help="wall time of the simulated job in hours (default %(default)s)")
    parser.add_argument("--seeds", type=int, default=20, help="independent jobs averaged (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default %(default)s)")
    parser.add_argument("--interval", type=float, action="append", default=None,
                        help="save interval T in seconds to tabulate (repeatable; default: a grid around T*)")
    parser.add_argument("--step-time", type=float, default=None,
                        help="seconds per training step: also print save_freq = T*/step")
    args = parser.parse_args(argv)
    args.mtbf, args.horizon = args.mtbf_hours * 3600.0, args.horizon_hours * 3600.0
    trace = read_trace(args.trace) if args.trace else None
    if trace is not None:  # the analytic columns use the trace's own mean interval
        args.mtbf = trace[-1] / len(trace)
        args.horizon = max(args.horizon, trace[-1])
    t_star = optimal_interval(args.save_stall, args.mtbf)
    grid = args.interval or sorted({t_star * f for f in (1 / 16, 1 / 4, 1 / 2, 1, 2, 4, 16)}
                                   | {60.0, 600.0, 1800.0})
    source = f"trace {args.trace} ({len(trace)} failures)" if trace else \
        f"exponential failures, {args.seeds} seeded jobs"
    print(f"goodput model: s = {args.save_stall * 1e3:.1f} ms a save, R = {args.restart:.2f} s a restart, "
          f"M = {args.mtbf / 3600:.2f} h, job of {args.horizon / 86400:.1f} days, {source}")
    print(f"analytic optimum T* = sqrt(2 s M) = {_duration(t_star)}")
    print(f"{'T (save interval)':>18s} {'simulated':>16s} {'first order':>12s} {'exact (exp)':>12s}")
    for interval in grid:
        mean, error = mean_goodput(interval, args, trace)
        mark = "  <- T*" if interval == t_star else ""
        print(f"{_duration(interval):>18s} {mean * 100:10.3f} ±{error * 100:.3f} "
              f"{goodput_first_order(interval, args.save_stall, args.restart, args.mtbf) * 100:11.3f}% "
              f"{goodput_exact(interval, args.save_stall, args.restart, args.mtbf) * 100:11.3f}%{mark}")
    at_optimum, _ = mean_goodput(t_star, args, trace)
    if args.step_time:
        print(f"at {args.step_time * 1e3:.0f} ms a step, T* is BackupAndRestore(save_freq="
              f"{max(1, round(t_star / args.step_time))})")
    verdict = "MET" if at_optimum >= GOAL else "NOT MET"
    print(f"RESULT goodput at M = {args.mtbf / 3600:.2f} h with T* = {_duration(t_star)}: "
          f"{at_optimum * 100:.2f} % (goal >= {GOAL * 100:.0f} %: {verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
