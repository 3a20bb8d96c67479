"""A worker's interpreter shutdown, with and without the heap frozen at exit; `--preload`'s pipe.

Part A. Each round starts fresh processes that import what a training worker imports (torch,
``torch._dynamo``, ``torch.distributed.checkpoint``, meshfit), each in two variants, interleaved:

- ``python``: Python's own shutdown (``MESHFIT_FREEZE_HEAP_AT_EXIT=0``);
- ``meshfit``: the handler a multi-worker process runs last at exit (`freeze_heap_at_exit`: garbage
  collected once, then ``gc.freeze``).

The child's first ``atexit`` handler (so the last to run) prints the time; the figure is from then to
the moment its output pipe closes, i.e. Python's shutdown, plus, for ``meshfit``, the handler's own
time (started before that stamp, so measured separately and added).

Part B. ``meshfit launch --workers 1 --preload`` of a one-line script: seconds from the launcher's last
line to the end of its output (the fork server holds the pipe until it has exited).

Run:  .venv/bin/python bench/bench_exit.py [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

CHILD = """\
import atexit, sys, time
atexit.register(lambda: print("stamp", time.time(), flush=True))
import torch, torch._dynamo, torch.distributed.checkpoint, meshfit
meshfit.Model
from meshfit._runtime import freeze_heap_at_exit

def timed():
    started = time.perf_counter()
    did = freeze_heap_at_exit()
    print("handler", time.perf_counter() - started, did, flush=True)

atexit.register(timed)
"""


def _shutdown(variant: str) -> tuple[float, float]:
    """(seconds from the last handler to the closed pipe, the freezing handler's own seconds)."""
    env = C.clean_env(MESHFIT_FREEZE_HEAP_AT_EXIT="1" if variant == "meshfit" else "0")
    proc = subprocess.Popen([C.python(), "-c", CHILD], stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
        closed = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
    fields = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    handler = float(fields["handler"].split()[0]) if variant == "meshfit" else 0.0
    return closed - float(fields["stamp"]), handler


def _preload_pipe() -> float:
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "hello.py")
        with open(script, "w") as f:
            f.write('print("hello", flush=True)\n')
        proc = subprocess.Popen([C.python(), "-m", "meshfit._cli", "launch", "--workers", "1", "--preload", script],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=C.clean_env(),
                                start_new_session=True)
        try:
            last = time.time()
            for _ in proc.stdout:  # type: ignore[union-attr]
                last = time.time()
            closed = time.time()
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    return closed - last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"python": [], "meshfit": []}
    handler: list[float] = []
    pipe: list[float] = []
    for round_ in range(args.rounds):
        order = ("python", "meshfit") if round_ % 2 == 0 else ("meshfit", "python")
        for variant in order:
            shutdown, spent = _shutdown(variant)
            times[variant].append(shutdown + spent)
            if variant == "meshfit":
                handler.append(spent)
        pipe.append(_preload_pipe())
    print(f"A. shutdown after the last line, {args.rounds} rounds (median [range], s):")
    for variant, values in times.items():
        print(f"   {variant:8s} {C.median(values):.2f} [{C.spread(values)}]")
    print(f"   of meshfit's, its handler (the collection and gc.freeze): {C.median(handler):.2f} [{C.spread(handler)}]")
    print(f"B. meshfit launch --preload: output closed after the launcher's last line: "
          f"{C.median(pipe):.2f} s [{C.spread(pipe)}]")


if __name__ == "__main__":
    main()
