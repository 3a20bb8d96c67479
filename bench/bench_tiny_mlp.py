"""``fit`` ÷ a hand-written loop on the tiny MLP, each variant a default process started as a user starts it.

The step of a 32-32-10 MLP at batch 32 is almost all framework: what ``fit`` adds per step shows here.
Each round starts ``python bench/_tiny_mlp.py VARIANT`` once per variant (reversed order every other
round; no tuning of the environment beyond one torch thread, which the script sets as a user does) and
takes the ratio of the per-step times of the timed epochs (2 of 3 epochs of 1,563 steps). Two pairs:

- ``fit`` ÷ ``hand``: ``fit`` on ``Dataset.from_tensor_slices((x, y)).shuffle(50000, seed=0).batch(32)``
  and the hand loop on the same batch order (the checksums of the final weights are printed: they agree
  to float rounding, ``fit``'s Adam being fused and torch's default not);
- ``fit-arrays`` ÷ ``hand-randperm``: Keras's usual ``model.fit(x, y, batch_size=32, epochs=3)`` against a
  loop that draws ``torch.randperm`` each epoch (each shuffles its own way: the same work, other batches);
- ``fit`` ÷ ``hand-fused``: the hand loop with ``torch.optim.Adam(..., fused=True)``, the implementation
  ``fit``'s Adam takes by default (torch's default is its per-parameter loop): what ``fit`` adds around the
  same kernels.

``--baseline DIR`` adds ``fit-before``: the ``fit`` variant with another meshfit tree (``git archive`` of an
older commit into DIR) first on ``PYTHONPATH``, in the same rounds: before and after in one run.
``--counts`` then starts one more process per variant (3 epochs) that counts the aten ops a step (a dispatch
mode) in its second epoch and the Python calls a step (``sys.setprofile``: calls and C calls) in its third, so
that the dispatch mode's own Python code is not counted as the step's calls. Host reads a step are the
``aten._local_scalar_dense`` ops among them: a tensor's value read into Python (``.item()``, ``float(t)``),
the host synchronisation a GPU step would wait for.

Reported: the median of the per-round ratios of CPU time per step (range in brackets), the same for wall
time, and each variant's median milliseconds a step. Target: ``fit`` ÷ hand ≤ 1.05.

Run:  .venv/bin/python bench/bench_tiny_mlp.py [--rounds R] [--epochs E] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

TARGET = 1.05
PAIRS = (("fit", "hand"), ("fit-arrays", "hand-randperm"), ("fit", "hand-fused"))


def run_variant(variant: str, epochs: int, tmp: str, counts: bool = False, baseline: str | None = None) -> dict:
    out = os.path.join(tmp, f"{variant}.json")
    env = C.clean_env()
    if variant == "fit-before":  # the fit variant, importing meshfit from the baseline tree
        variant, env["PYTHONPATH"] = "fit", os.path.abspath(str(baseline))
    argv = [C.python(), os.path.join(C.BENCH, "_tiny_mlp.py"), variant, "--epochs", str(epochs), "--out", out]
    argv += ["--counts"] if counts else []
    C.run_children([(variant, argv, env)], timeout=600)
    return C.read_json(out)


def host_reads(counted: dict) -> float:
    """Tensor values read into Python a step (``.item()``, ``float(t)``: ``aten._local_scalar_dense``)."""
    steps = counted["ops"] and sum(counted["ops_by_name"].values()) / counted["ops"]
    return counted["ops_by_name"].get("aten._local_scalar_dense.default", 0) / steps if steps else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 5; quick 1)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs a process, the first a warm-up (default 3)")
    parser.add_argument("--quick", action="store_true", help="one round of 2 epochs: checks that it works")
    parser.add_argument("--counts", action="store_true", help="also count Python calls and aten ops a step")
    parser.add_argument("--baseline", default=None, help="another meshfit tree: adds its fit as fit-before")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 5)
    epochs = args.epochs or (2 if args.quick else 3)
    pairs = PAIRS + ((("fit-before", "hand"),) if args.baseline else ())
    variants = list(dict.fromkeys(v for pair in pairs for v in pair))
    print(f"tiny MLP 32-32-10, Adam, batch 32, 50,000 examples, 1 thread; {rounds} rounds, {epochs} epochs a "
          f"process (the first a warm-up); {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}", flush=True)
    print("command: " + C.command_line([C.python(), "bench/_tiny_mlp.py", "VARIANT", "--epochs", str(epochs),
                                        "--out", "OUT"]), flush=True)
    results: dict[str, list[dict]] = {v: [] for v in variants}
    counted: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="meshfit-bench-") as tmp:
        for r in range(rounds):
            for variant in variants if r % 2 == 0 else variants[::-1]:
                results[variant].append(run_variant(variant, epochs, tmp, baseline=args.baseline))
            print(f"round {r + 1}: " + ", ".join(f"{v} {results[v][-1]['cpu_ms']:.4f}" for v in variants)
                  + " CPU ms/step", flush=True)
        if args.counts:
            counted = {v: run_variant(v, 3, tmp, counts=True, baseline=args.baseline) for v in variants}
    print(f"load at the end {os.getloadavg()[0]:.2f}")
    print("| pair | ms/step (CPU) | CPU ratio | wall ratio | weights' checksums |")
    print("|---|---|---|---|---|")
    if args.baseline:
        print(f"fit-before imported {results['fit-before'][0]['meshfit']}; fit {results['fit'][0]['meshfit']}")
    for num, den in pairs:
        cpu = C.ratios([x["cpu_ms"] for x in results[num]], [x["cpu_ms"] for x in results[den]])
        wall = C.ratios([x["wall_ms"] for x in results[num]], [x["wall_ms"] for x in results[den]])
        ms = f"{C.median([x['cpu_ms'] for x in results[num]]):.4f} / {C.median([x['cpu_ms'] for x in results[den]]):.4f}"
        sums = f"{results[num][0]['checksum']:.9g} / {results[den][0]['checksum']:.9g}"
        print(f"| `{num}` ÷ `{den}` | {ms} | **{C.median(cpu):.3f}** {C.spread(cpu)} | "
              f"{C.median(wall):.3f} {C.spread(wall)} | {sums} |")
    if counted:
        print("| variant | Python calls a step | aten ops a step | host reads a step |")
        print("|---|---|---|---|")
        for v in variants:
            print(f"| `{v}` | {counted[v]['calls']:.1f} | {counted[v]['ops']:.1f} | {host_reads(counted[v]):.3f} |")
    cpu = C.ratios([x["cpu_ms"] for x in results["fit"]], [x["cpu_ms"] for x in results["hand"]])
    print(f"fit ÷ hand, CPU: {C.median(cpu):.3f} — {C.verdict(C.median(cpu), TARGET)}")


if __name__ == "__main__":
    main()
