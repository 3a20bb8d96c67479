"""fit's per-step overhead on the CPU: process CPU time and dispatched aten ops per step, fit vs hand.

On a GPU a small model is launch-bound: its step time is the CPU time spent in Python and in
launching kernels, so what ``Model.fit`` adds per step (Python layers, extra kernels) is what
``bench_gpu.py``'s ratio shows. This script measures the same two loops as ``bench_gpu.py`` on the
CPU, one torch thread, with two figures that a loaded machine does not distort much:

- CPU time per step (``time.process_time``), hand and fit alternating in blocks of ``--steps``
  steps (one ``fit`` call per block, as ``bench_gpu.py``), the order flipping every round;
- aten ops per step, counted under a ``TorchDispatchMode`` (every op that reaches a kernel,
  forward, backward and optimizer, factory functions included): per block ÷ steps (fit's per-call
  work amortised, as in the timing), and fit's marginal ops per step (blocks of 2S minus S steps);
- Python calls per step (``sys.setprofile``: Python functions and C functions called from Python),
  the same two ways: a count of the interpreter's work, which no load on the machine changes.

The hand loop is ``bench_gpu.py``'s: sliced inputs, ``zero_grad; cross_entropy(model(x), y).backward();
step`` with ``torch.optim.SGD(lr=0.01)`` (its marginal figures equal its per-block ones); fit is
``fit(x, y, batch_size=B, shuffle=False, verbose=0)`` compiled with SGD 0.01, sparse cross-entropy
from logits and ``metrics=["accuracy"]``.
Workloads: a tiny MLP (8-32-4, where overhead is most of a step) and the seed CNN, batch 64.

``--baseline DIR`` also runs this script on another meshfit tree (e.g. ``git archive`` of an older
commit, unpacked in DIR) in child processes, alternating with this tree round by round, and prints
both figures side by side (before = DIR, after = this tree).

Run:  .venv/bin/python bench/bench_step_overhead.py [--quick] [--rounds R] [--steps S] [--baseline DIR]
      [--ops-detail] [--only mlp|cnn] [--verbose 0|1]
"""

from __future__ import annotations

import argparse
import collections
import copy
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

BATCH = 64


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active (by overload name)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _workloads() -> list[tuple[str, Callable[[], nn.Module], np.ndarray, np.ndarray]]:
    import _common as C  # the seed CNN and the digits (bench/_common.py)

    rng = np.random.default_rng(0)
    x_mlp = rng.standard_normal((4096, 8)).astype("float32")
    y_mlp = rng.integers(0, 4, size=4096).astype("int64")
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    x_cnn, y_cnn = C.load_train()
    torch.manual_seed(0)
    cnn = C.materialised_seed_module(torch.from_numpy(x_cnn[:2]))
    return [("tiny MLP", lambda: copy.deepcopy(mlp), x_mlp, y_mlp),
            ("seed CNN", lambda: copy.deepcopy(cnn), x_cnn, y_cnn)]


class Pair:
    """The hand loop and fit on copies of one module, each reading its own position in the data."""

    def __init__(self, make: Callable[[], nn.Module], x: np.ndarray, y: np.ndarray, rows: int) -> None:
        import _common as C

        import meshfit as mf

        reps = -(-rows // len(x))  # whole copies of the data, so that every block reads full batches
        self.x, self.y = np.concatenate([x] * reps), np.concatenate([y] * reps)
        self.x_t, self.y_t = torch.from_numpy(x), torch.from_numpy(y)
        self.hand = make()
        self.hand.train()
        self.optimizer = torch.optim.SGD(self.hand.parameters(), lr=0.01)
        self.model = mf.Model(make())
        C.compile_seed(self.model)
        self.at = {"hand": 0, "fit": 0}

    def _rows(self, name: str, steps: int) -> int:
        need = steps * BATCH
        if need > len(self.x):
            raise ValueError(f"a block of {steps} steps needs {need} rows; the data has {len(self.x)}")
        start = self.at[name]
        if start + need > len(self.x):
            start = 0
        self.at[name] = start + need
        return start

    def hand_block(self, steps: int) -> None:
        start = self._rows("hand", steps)
        x, y, hand, optimizer = self.x_t, self.y_t, self.hand, self.optimizer
        for i in range(start, start + steps * BATCH, BATCH):
            xb, yb = x[i:i + BATCH], y[i:i + BATCH]
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(hand(xb), yb).backward()
            optimizer.step()

    verbose = 0  # 1: fit's live progress bar, writing to a file (see --verbose)

    def fit_block(self, steps: int) -> None:
        import meshfit as mf

        start = self._rows("fit", steps)
        stop = start + steps * BATCH
        bar = [mf.callbacks.ProgbarLogger(stream=io.StringIO())] if self.verbose else []
        self.model.fit(self.x[start:stop], self.y[start:stop], batch_size=BATCH, epochs=1, shuffle=False,
                       verbose=self.verbose, callbacks=bar)


def _cpu_per_step(run: Callable[[int], None], steps: int) -> float:
    began = time.process_time()
    run(steps)
    return (time.process_time() - began) * 1e3 / steps


def _ops(run: Callable[[int], None], steps: int) -> collections.Counter[str]:
    with OpCounter() as counter:
        run(steps)
    return counter.counts


def _calls(run: Callable[[int], None], steps: int) -> int:
    count = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        run(steps)
    finally:
        sys.setprofile(None)
    return count


def measure(rounds: int, steps: int, detail: bool, timed: bool = True, only: str | None = None,
            verbose: int = 0) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    results = []
    for name, make, x, y in _workloads():
        if only is not None and not name.lower().endswith(only):
            continue
        pair = Pair(make, x, y, 2 * steps * BATCH)
        pair.verbose = verbose
        runs = {"hand": pair.hand_block, "fit": pair.fit_block}
        cpu: dict[str, list[float]] = {"hand": [], "fit": []}
        for r in range(rounds + 1 if timed else 1):  # round 0 warms up
            for variant in (("hand", "fit") if r % 2 == 0 else ("fit", "hand")):
                value = _cpu_per_step(runs[variant], steps)
                if r:
                    cpu[variant].append(value)
        ops = {v: _ops(runs[v], steps) for v in runs}
        ops_2s = {v: _ops(runs[v], 2 * steps) for v in runs}
        marginal = {v: (sum(ops_2s[v].values()) - sum(ops[v].values())) / steps for v in runs}
        calls = {v: _calls(runs[v], steps) for v in runs}
        calls_2s = {v: _calls(runs[v], 2 * steps) for v in runs}
        nan = float("nan")
        result = {"name": name, "steps": steps,
                  "cpu_hand": _median(cpu["hand"]) if cpu["hand"] else nan,
                  "cpu_fit": _median(cpu["fit"]) if cpu["fit"] else nan,
                  "cpu_ratio": _median([f / h for f, h in zip(cpu["fit"], cpu["hand"], strict=True)]) if cpu["fit"] else nan,
                  "ops_hand": sum(ops["hand"].values()) / steps, "ops_fit": sum(ops["fit"].values()) / steps,
                  "marginal_hand": marginal["hand"], "marginal_fit": marginal["fit"],
                  "calls_hand": calls["hand"] / steps, "calls_fit": calls["fit"] / steps,
                  "calls_marginal_hand": (calls_2s["hand"] - calls["hand"]) / steps,
                  "calls_marginal_fit": (calls_2s["fit"] - calls["fit"]) / steps}
        if detail:
            extra = collections.Counter({k: (ops_2s["fit"][k] - ops["fit"][k]) / steps
                                         - (ops_2s["hand"][k] - ops["hand"][k]) / steps
                                         for k in set(ops_2s["fit"]) | set(ops_2s["hand"])})
            result["extra_ops"] = {k: v for k, v in extra.most_common() if v}
        results.append(result)
    return results


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _print(results: list[dict[str, Any]], label: str = "") -> None:
    print(f"{label}{'model':<10} {'CPU ms/step hand':>16} {'fit':>7} {'fit/hand':>8} "
          f"{'ops/step hand':>13} {'fit':>6} {'marginal':>8} {'py calls/step hand':>18} {'fit':>6} {'marginal':>8}")
    for r in results:
        print(f"{label}{r['name']:<10} {r['cpu_hand']:>16.3f} {r['cpu_fit']:>7.3f} {r['cpu_ratio']:>8.3f} "
              f"{r['ops_hand']:>13.1f} {r['ops_fit']:>6.1f} {r['marginal_fit']:>8.1f} "
              f"{r['calls_hand']:>18.1f} {r['calls_fit']:>6.1f} {r['calls_marginal_fit']:>8.1f}")
        if "extra_ops" in r:
            print(f"{label}  fit's extra ops per step (marginal, fit - hand): "
                  + ", ".join(f"{k} {v:+g}" for k, v in r["extra_ops"].items()))


def _child(tree: str, rounds: int, steps: int, only: str | None = None) -> list[dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    argv = [sys.executable, os.path.join(tree, "bench", "bench_step_overhead.py"), "--json",
            "--rounds", str(rounds), "--steps", str(steps), *(["--only", only] if only else [])]
    if not os.path.exists(argv[1]):  # a tree from before this script: run this one with its meshfit
        argv[1] = os.path.abspath(__file__)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=1800)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} (PYTHONPATH={tree}) failed with exit code {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def compare(baseline: str, rounds: int, steps: int, only: str | None = None) -> None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs: dict[str, list[list[dict[str, Any]]]] = {"before": [], "after": []}
    trees = {"before": os.path.abspath(baseline), "after": here}
    for r in range(rounds):
        for label in (("before", "after") if r % 2 == 0 else ("after", "before")):
            runs[label].append(_child(trees[label], 2, steps, only))
            print(f"round {r + 1}/{rounds}: {label} done", flush=True)
    print(f"\nbefore = {trees['before']}, after = {trees['after']}; {rounds} child processes each, alternating; "
          "CPU figures: median over the children of their medians")
    for label in ("before", "after"):
        merged = []
        for i, first in enumerate(runs[label][0]):
            merged.append({**first, **{k: _median([run[i][k] for run in runs[label]])
                                       for k in ("cpu_hand", "cpu_fit", "cpu_ratio")}})
        _print(merged, f"{label:>6}: ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run (2 rounds of 10 steps)")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 7; quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="steps per block (default 50; quick 10)")
    parser.add_argument("--baseline", default=None, help="another meshfit tree to compare with (before)")
    parser.add_argument("--ops-detail", action="store_true", help="list the aten ops fit adds per step")
    parser.add_argument("--counts-only", action="store_true", help="only the op and call counts (no timing)")
    parser.add_argument("--only", choices=("mlp", "cnn"), default=None, help="one workload (default: both)")
    parser.add_argument("--verbose", type=int, choices=(0, 1), default=0,
                        help="fit's verbose (1: its progress bar, writing to a file; not with --baseline)")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    rounds, steps = args.rounds or (2 if args.quick else 7), args.steps or (10 if args.quick else 50)
    if args.baseline:
        compare(args.baseline, rounds, steps, args.only)
        return
    results = measure(rounds, steps, args.ops_detail, timed=not args.counts_only, only=args.only, verbose=args.verbose)
    if args.json:
        print(json.dumps(results))
        return
    print(f"bench_step_overhead: CPU, 1 torch thread, batch {BATCH}, {rounds} rounds x {steps} steps a variant "
          "after 1 warm-up round (order alternates); CPU time = process time")
    _print(results)


if __name__ == "__main__":
    main()
