"""``import torch`` and ``import meshfit`` timed in fresh default processes, interleaved; a process of ``bench_all.py``.

Each import runs in its own ``python -c`` child (a user's cold start, the file cache warm), ``--pairs``
times each, alternating which goes first. One pair is one torch and one meshfit process started back
to back, so the per-pair ratio compares two moments of the same machine state; ``bench_all.py``
takes the median of those ratios. meshfit's package loads at its first public name (a bare ``import
meshfit`` imports no torch), so its process times ``import meshfit; meshfit.Model``: what a program's
first line that uses meshfit costs. Writes ``{"torch_s": [...], "meshfit_s": [...]}`` to --out.
"""

import argparse
import json
import subprocess
import sys

CODE = "import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
STATEMENTS = {"torch": "import torch", "meshfit": "import meshfit; meshfit.Model"}


def time_import(module: str, timeout: float) -> float:
    done = subprocess.run([sys.executable, "-c", CODE.format(statement=STATEMENTS[module])], capture_output=True, text=True,
                          timeout=timeout, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per import process")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"torch": [], "meshfit": []}
    for i in range(args.pairs):
        for module in ("torch", "meshfit") if i % 2 == 0 else ("meshfit", "torch"):
            times[module].append(time_import(module, args.timeout))
    with open(args.out, "w") as f:
        json.dump({"torch_s": times["torch"], "meshfit_s": times["meshfit"]}, f)


if __name__ == "__main__":
    main()
