"""``Model.fit`` ÷ a hand-written PyTorch loop on one GPU: the seed CNN and a small transformer.

Issue 23's target: fit / hand-written <= 1.02 (median of per-round ratios of wall time), in one
default process (no tuning), both variants in the same run, alternating in blocks of ``--steps``
steps, one warm-up round then ``--rounds`` measured rounds, the order flipping every round.

- hand: the inputs live in pinned CPU memory; each step slices a batch, copies it with
  ``non_blocking=True``, then ``zero_grad; cross_entropy(model(x), y).backward(); step``;
- fit: ``model.fit(x_block, y_block, batch_size=B, shuffle=False, verbose=0)`` over the same
  batches, compiled with ``metrics=["accuracy"]`` (a user's ``fit``; no per-batch log reader);
- fit-jit: the same with ``compile(..., jit_compile=True)`` (the module through ``torch.compile``), unless
  ``--no-jit``. Its warm-up block holds the compilation: reported apart as "compile s" (that block's
  time less its steps at the steady rate); its ratio to the hand loop is taken over the measured rounds
  (target <= 0.8 on the seed CNN).

A block ends with ``torch.cuda.synchronize()`` so that it is timed to the end of its GPU work.
Reported per model: ms/step and samples/s of each variant, the ratio, the GPU memory high-water mark
(``torch.cuda.max_memory_allocated`` during that variant's blocks), and the GPU's model and driver.
``make gpu-check`` passes ``--tests-xml`` (pytest's junit file of the ``gpu`` tests) so that the
one report also says how those tests went. Without CUDA it says so and exits 0 (``--device cpu``
runs the same code on the CPU, to check the script itself).

Run:  .venv/bin/python bench/bench_gpu.py [--quick] [--rounds R] [--steps S] [--device cuda:0]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import meshfit as mf  # noqa: E402

TARGET = 1.02
JIT_TARGET = 0.8  # jit_compile=True ÷ the eager hand loop, on the seed CNN, after compilation


class SmallTransformer(nn.Module):
    """Token classifier: embedding, 2 pre-norm encoder layers (d 128, 4 heads), mean pool, linear."""

    def __init__(self, vocab: int = 1000, length: int = 64, width: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(length, width))
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens) + self.position).mean(dim=1))


def _workloads(quick: bool) -> list[tuple[str, Callable[[], nn.Module], np.ndarray, np.ndarray, int]]:
    x, y = C.load_train()
    torch.manual_seed(0)
    cnn = C.materialised_seed_module(torch.from_numpy(x[:2]))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, size=(len(x), 64)).astype("int64")
    labels = (tokens[:, :8].sum(axis=1) % 10).astype("int64")
    torch.manual_seed(0)
    transformer = SmallTransformer()
    batch = 32 if quick else 64
    return [("seed CNN", lambda: _copy(cnn), x, y, batch),
            ("small transformer", lambda: _copy(transformer), tokens, labels, batch)]


def _copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(name: str, make: Callable[[], nn.Module], x: np.ndarray, y: np.ndarray, batch: int,
             device: torch.device, rounds: int, steps: int, jit: bool = True) -> dict[str, Any]:
    per_block = steps * batch
    blocks = rounds + 1
    need = blocks * per_block
    reps = -(-need // len(x))
    x_all, y_all = np.concatenate([x] * reps)[:need], np.concatenate([y] * reps)[:need]
    x_host, y_host = torch.from_numpy(x_all), torch.from_numpy(y_all)
    if device.type == "cuda":
        x_host, y_host = x_host.pin_memory(), y_host.pin_memory()

    hand = make().to(device)
    hand.train()
    optimizer = torch.optim.SGD(hand.parameters(), lr=0.01)
    strategy = mf.OneDeviceStrategy(str(device))
    with strategy.scope():
        model = mf.Model(make())
        C.compile_seed(model)
        jitted = mf.Model(make())
        C.compile_seed(jitted, jit_compile=True)
    counters = {"hand": 0, "fit": 0, "fit-jit": 0}
    peaks = {"hand": 0, "fit": 0, "fit-jit": 0}
    first_block_s: list[float] = []

    def hand_block() -> tuple[float, float, float]:
        start = counters["hand"] * per_block
        counters["hand"] += 1
        _reset_peak(device)
        clock = C.Clock()
        for i in range(start, start + per_block, batch):
            xb = x_host[i:i + batch].to(device, non_blocking=True)
            yb = y_host[i:i + batch].to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(hand(xb), yb).backward()
            optimizer.step()
        _synchronize(device)
        peaks["hand"] = max(peaks["hand"], _peak(device))
        return clock.per(steps)

    def fitting(variant: str, trained: mf.Model) -> Callable[[], tuple[float, float, float]]:
        def block() -> tuple[float, float, float]:
            start = counters[variant] * per_block
            counters[variant] += 1
            _reset_peak(device)
            clock = C.Clock()
            began = time.perf_counter()
            trained.fit(x_all[start:start + per_block], y_all[start:start + per_block], batch_size=batch, epochs=1,
                        shuffle=False, verbose=0)
            _synchronize(device)
            if variant == "fit-jit" and counters[variant] == 1:
                first_block_s.append(time.perf_counter() - began)
            peaks[variant] = max(peaks[variant], _peak(device))
            return clock.per(steps)
        return block

    blocks = {"hand": hand_block, "fit": fitting("fit", model)}
    if jit:
        blocks["fit-jit"] = fitting("fit-jit", jitted)
    print(f"bench_gpu: {name}, batch {batch}, SGD lr 0.01, {rounds} rounds x {steps} steps per variant after "
          "1 warm-up round (order alternates)", flush=True)
    times = C.interleave(blocks, rounds)
    C.print_rounds(f"{name}: wall time", times["wall"], ratio_of=("fit", "hand"))
    result = {"name": name, "batch": batch, "hand_ms": C.median(times["wall"]["hand"]),
              "fit_ms": C.median(times["wall"]["fit"]),
              "ratio": C.median(C.ratios(times["wall"]["fit"], times["wall"]["hand"])),
              "spread": C.spread(C.ratios(times["wall"]["fit"], times["wall"]["hand"])),
              "hand_peak": peaks["hand"], "fit_peak": peaks["fit"], "weight_diff": _weight_diff(hand, model)}
    if jit:
        jit_ms = C.median(times["wall"]["fit-jit"])
        result.update(jit_ms=jit_ms, jit_ratio=C.median(C.ratios(times["wall"]["fit-jit"], times["wall"]["hand"])),
                      jit_spread=C.spread(C.ratios(times["wall"]["fit-jit"], times["wall"]["hand"])),
                      compile_s=max(first_block_s[0] - steps * jit_ms / 1000, 0.0), jit_peak=peaks["fit-jit"],
                      jit_weight_diff=_weight_diff(hand, jitted), jit_compiled=bool(jitted.jit_compile))
    return result


def _weight_diff(hand: nn.Module, trained: mf.Model) -> float:
    """The largest difference between the hand loop's weights and a ``fit`` variant's (the same batches)."""
    return max((a - b).abs().max().item() for a, b in zip(hand.parameters(), trained.module.parameters(), strict=True))


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def _gpu_description(device: torch.device) -> str:
    if device.type != "cuda":
        return f"no GPU: ran on {device} (a check of the script, not a GPU figure)"
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        driver_version = driver[device.index or 0] if driver else "unknown"
    except (OSError, subprocess.SubprocessError, IndexError):
        driver_version = "unknown (nvidia-smi failed)"
    memory = torch.cuda.get_device_properties(device).total_memory / 2**30
    return (f"{torch.cuda.get_device_name(device)} ({memory:.0f} GiB), driver {driver_version}, "
            f"CUDA {torch.version.cuda}, torch {torch.__version__}")


def _test_summary(path: str | None) -> str:
    if not path:
        return "not run (make gpu-check runs them first)"
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as error:
        return f"unreadable junit file {path!r}: {error}"
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return f"no testsuite in {path!r}"
    total, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    return f"{total - failed - skipped} passed, {failed} failed, {skipped} skipped (of {total})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short smoke run (2 rounds of 10 steps)")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 7; quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="steps per block (default 50; quick 10)")
    parser.add_argument("--device", default=None, help="default cuda:0 (cpu: check the script without a GPU)")
    parser.add_argument("--tests-xml", default=None, help="pytest's junit XML of the gpu tests, for the report")
    parser.add_argument("--no-jit", action="store_true", help="leave out fit with jit_compile=True")
    args = parser.parse_args()
    rounds, steps = args.rounds or (2 if args.quick else 7), args.steps or (10 if args.quick else 50)
    if args.device is None and not torch.cuda.is_available():
        print("meshfit GPU check\n  GPU: none (torch.cuda.is_available() is False): nothing measured\n"
              f"  gpu tests: {_test_summary(args.tests_xml)}")
        return
    device = torch.device(args.device or "cuda:0")
    began = time.monotonic()
    results = [_measure(name, make, x, y, batch, device, rounds, steps, jit=not args.no_jit)
               for name, make, x, y, batch in _workloads(args.quick)]
    print("\n==== meshfit GPU check ====")
    print(f"GPU: {_gpu_description(device)}")
    print(f"gpu tests: {_test_summary(args.tests_xml)}")
    print(f"bench: {rounds} rounds x {steps} steps a variant, one default process, {time.monotonic() - began:.0f} s")
    print(f"{'model':<18} {'batch':>5} {'hand ms/step':>12} {'fit ms/step':>11} {'hand samples/s':>14} "
          f"{'fit samples/s':>13} {'fit/hand':>8} {'spread':>13} {'peak MiB hand/fit':>17} {'target':>7}")
    for r in results:
        peaks = f"{r['hand_peak'] / 2**20:.0f}/{r['fit_peak'] / 2**20:.0f}"
        print(f"{r['name']:<18} {r['batch']:>5} {r['hand_ms']:>12.3f} {r['fit_ms']:>11.3f} "
              f"{r['batch'] * 1000 / r['hand_ms']:>14.0f} {r['batch'] * 1000 / r['fit_ms']:>13.0f} "
              f"{r['ratio']:>8.3f} {r['spread']:>13} {peaks:>17} {C.verdict(r['ratio'], TARGET):>7}")
        print(f"{'':<18} same work check: max |hand - fit| weight difference {r['weight_diff']:.2e}")
        if "jit_ms" in r:
            target = C.verdict(r["jit_ratio"], JIT_TARGET) if r["name"] == "seed CNN" else "-"
            how = "compiled" if r["jit_compiled"] else "run eagerly (meshfit's rule on a CPU)"
            print(f"{'':<18} jit_compile=True, {how}: {r['jit_ms']:.3f} ms/step, ÷ hand {r['jit_ratio']:.3f} {r['jit_spread']}"
                  f" (target <= {JIT_TARGET} on the seed CNN: {target}), compile {r['compile_s']:.1f} s, peak "
                  f"{r['jit_peak'] / 2**20:.0f} MiB, max |hand - fit-jit| weight difference {r['jit_weight_diff']:.2e}")


if __name__ == "__main__":
    main()
