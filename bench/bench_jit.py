"""``compile(jit_compile=True)`` ÷ eager, seed CNN and keras.io's MLP, each variant in its own default process.

Three variants per model, every one a fresh ``python bench/_cnn_fit.py`` / ``_mlp_fit.py`` as a user
runs it (one thread, the first epoch a warm-up that holds any compilation):
- ``eager``: ``jit_compile=False``;
- ``jit``: ``jit_compile=True`` as a user writes it (on CPU meshfit runs it eagerly and warns);
- ``jit_forced``: ``jit_compile=True`` with ``MESHFIT_JIT_COMPILE_ON_CPU=1`` (torch.compile on CPU
  anyway): the measurement behind that choice.
Rounds interleave the variants (reversed every other round); printed: ms/step per round and the
median of the per-round ratios to ``eager``. No assertions.

    .venv/bin/python bench/bench_jit.py [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
from bench_all import _write_mlp_data, user_env  # noqa: E402

VARIANTS = {"eager": ("false", {}), "jit": ("true", {}),
            "jit_forced": ("true", {"MESHFIT_JIT_COMPILE_ON_CPU": "1"})}


def commands(args: argparse.Namespace, data: str) -> dict[str, tuple[list[str], dict[str, str]]]:
    py, bench = sys.executable, C.BENCH
    scripts = {"cnn": [os.path.join(bench, "_cnn_fit.py"), "--steps", str(args.cnn_steps)],
               "mlp": [os.path.join(bench, "_mlp_fit.py"), "--data", data, "--steps", str(args.mlp_steps)]}
    return {f"{model}_{name}": ([py, *script, "--jit-compile", flag], user_env(**env))
            for model, script in scripts.items() for name, (flag, env) in VARIANTS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cnn-steps", type=int, default=40)
    parser.add_argument("--mlp-steps", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="1 round of short runs: checks that it works")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.cnn_steps, args.mlp_steps = 1, 8, 40
    cores, load = os.cpu_count(), os.getloadavg()[0]
    print(f"bench_jit: {cores} cores, load average {load:.2f}" + (" (MEASURED UNDER LOAD)" if load > (cores or 1)
                                                                  else ""), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_jit_") as tmp:
        data = os.path.join(tmp, "digits784.npz")
        _write_mlp_data(data)
        plan = commands(args, data)
        for name, (argv, env) in plan.items():
            print(f"  {name}: {C.command_line(argv, env, ['MESHFIT_JIT_COMPILE_ON_CPU'])}", flush=True)
        per_round: dict[str, list[float]] = {name: [] for name in plan}
        for r in range(args.rounds):
            for name in (list(plan) if r % 2 == 0 else list(plan)[::-1]):
                argv, env = plan[name]
                out = os.path.join(tmp, f"{name}.json")
                C.run_children([(name, [*argv, "--out", out], env)], timeout=900)
                per_round[name].append(C.read_json(out)["ms_per_step"])
            print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.2f}" for n, v in per_round.items()), flush=True)
    for model in ("cnn", "mlp"):
        names = [f"{model}_{v}" for v in VARIANTS]
        C.print_rounds(f"{model}", {n: per_round[n] for n in names},
                       ratio_of=(names[1], names[0], names[2], names[0]))
        for variant in names[1:]:
            ratio = C.median(C.ratios(per_round[variant], per_round[names[0]]))
            print(f"RESULT {variant} {C.median(per_round[variant]):.2f} ms/step, {names[0]} "
                  f"{C.median(per_round[names[0]]):.2f} ms/step; median ratio {ratio:.3f} "
                  f"(rounds {C.spread(C.ratios(per_round[variant], per_round[names[0]]))})")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
