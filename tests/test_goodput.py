"""bench/goodput.py: the event-driven goodput simulator against the formulas, a hand-checked trace."""

from __future__ import annotations

import importlib.util
import math
import os
import statistics
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("goodput", os.path.join(ROOT, "bench", "goodput.py"))
goodput = importlib.util.module_from_spec(_spec)
sys.modules["goodput"] = goodput  # dataclasses look their module up
_spec.loader.exec_module(goodput)

# A regime where the first-order formula holds: s, R << T* << M.
S, R, M = 1.0, 5.0, 1.0e4
HORIZON = 2.0e8  # ~20,000 failures a job


def _simulated(interval: float, seeds: int = 6) -> tuple[float, float]:
    values = [goodput.simulate(interval, S, R, goodput.exponential_failures(M, seed), HORIZON).goodput
              for seed in range(seeds)]
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(seeds)


def test_simulator_matches_the_exact_and_first_order_formulas():
    t_star = goodput.optimal_interval(S, M)
    assert t_star == pytest.approx(math.sqrt(2 * S * M))
    for interval in (t_star / 2, t_star, 2 * t_star):
        mean, error = _simulated(interval)
        exact = goodput.goodput_exact(interval, S, R, M)
        assert abs(mean - exact) < max(4 * error, 2e-4), (interval, mean, exact, error)
        assert mean == pytest.approx(goodput.goodput_first_order(interval, S, R, M), abs=1e-3)
    # at T*, 1 - sqrt(2 s / M) - R / M
    assert _simulated(t_star)[0] == pytest.approx(1 - math.sqrt(2 * S / M) - R / M, abs=1e-3)


def test_simulated_optimum_is_at_t_star():
    t_star = goodput.optimal_interval(S, M)
    grid = [t_star * f for f in (1 / 4, 1 / 2, 1, 2, 4)]
    best = max(grid, key=lambda t: _simulated(t, seeds=3)[0])
    assert best == t_star


def test_trace_replay_by_hand():
    # T=10 s of training + s=1 s save = 11 s periods, R=5 s. Failures at 25 and 27 (during the restart)
    # and 100; horizon 120. 0..22: 2 saves (20 s kept), 25 fails, 27 fails again, resumed at 32;
    # 32..98: 6 saves (80 kept), 100 fails, resumed at 105; 105..116: 1 save (90), tail 4 s: 94 kept.
    result = goodput.simulate(10.0, 1.0, 5.0, iter([25.0, 27.0, 100.0]), horizon=120.0)
    assert (result.wall, result.useful, result.failures, result.saves) == (120.0, 94.0, 3, 9)
    assert result.goodput == pytest.approx(94 / 120)


def test_no_failures_costs_only_the_saves():
    result = goodput.simulate(9.0, 1.0, 5.0, iter([]), horizon=1000.0)
    assert result.failures == 0 and result.saves == 100
    assert result.goodput == pytest.approx(0.9)


def test_read_trace_and_bad_input(tmp_path):
    path = tmp_path / "trace.txt"
    path.write_text("# failure times\n30\n\n10.5  # a comment\n")
    assert goodput.read_trace(str(path)) == [10.5, 30.0]
    path.write_text("10\nsoon\n")
    with pytest.raises(ValueError, match=r"trace\.txt:2: expected a time in seconds, received 'soon'"):
        goodput.read_trace(str(path))
    with pytest.raises(ValueError, match=r"interval=0"):
        goodput.simulate(0, S, R, iter([]), 10.0)


def test_main_prints_the_table_and_the_goodput_at_the_published_mtbf(capsys):
    assert goodput.main(["--seeds", "2", "--step-time", "0.02"]) == 0
    out = capsys.readouterr().out
    assert "T* = sqrt(2 s M) = 39.5 s" in out          # s = 70 ms, M = 54 * 24 / 419 h
    assert "save_freq=1974" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
    assert float(line.split(": ")[1].split(" %")[0]) > 99.0
