"""2-worker ``fit`` vs a hand-written DDP loop, and 1-worker vs 2-worker throughput.

Issue target: 2-worker fit / hand-written DDP (gloo) <= 1.05 (median of per-round ratios).

The driver starts 2 worker processes of ``bench/_mw_worker.py --mode ddp`` with a ``TF_CONFIG`` each
(free localhost ports, one torch thread each, own sessions, killed at the end). Each worker builds
``MultiWorkerMirroredStrategy()`` and then, per round, runs three blocks of ``--steps`` steps
separated by ``dist.barrier()`` (order reversed every other round; one warm-up round):

- fit2w: ``model.fit(dataset, steps_per_epoch=S, epochs=1, verbose=0)``, the dataset batched with the
  global batch 128 and split by the strategy (64 rows per worker);
- ddp2w: ``DistributedDataParallel`` of its own copy of the model on the same (already initialised)
  default gloo process group, plain ``zero_grad / F.cross_entropy / backward / step`` on its 64 rows
  of the same global batches;
- fit1w: rank 0 alone trains a one-device ``fit`` model on the same global batches of 128 while
  rank 1 waits at the barrier (so the single worker has the machine as it would alone).

Reported: rank 0's wall ms per step for each, the median per-round ratio fit2w/ddp2w (target), and
throughput (examples/s = 128 / step time) as 2-worker / 1-worker (speedup; ideal 2.0) and its
inverse 1-worker / 2-worker (ideal 0.5). CPU time (summed over both ranks) is printed as the steadier
proxy on a loaded machine.

``--model mlp`` runs the same three variants on the tiny MLP (32-32-10, Adam, global batch 64: 32 rows
per worker; see ``_common.workload``), where a step is almost all framework and the hand loop is the
limit.

``--backup`` gives ``fit`` a ``BackupAndRestore(save_freq=10**9)`` (a fresh folder a block, never saved to
inside it): it handles preemption, so the workers share the flag at checks about every quarter second.

Run:  .venv/bin/python bench/bench_multiworker.py [--quick] [--rounds R] [--steps S] [--model cnn|mlp]
      [--batch-hook] [--backup] [--steps-per-execution N]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short smoke run (3 rounds of 15 steps)")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 7; quick 3)")
    parser.add_argument("--steps", type=int, default=None, help="steps per block (default 40, mlp 300; quick 15, mlp 100)")
    parser.add_argument("--tune-malloc", action="store_true", help="mallopt-tune glibc in the workers")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before the workers are killed")
    parser.add_argument("--model", choices=("cnn", "mlp"), default="cnn",
                        help="the seed CNN (SGD, global batch 128) or the tiny MLP (Adam, global batch 64)")
    parser.add_argument("--steps-per-execution", type=int, default=1, help="compile's steps_per_execution for fit")
    parser.add_argument("--batch-hook", action="store_true",
                        help="give fit a callback with an on_train_batch_end (the flags are then shared every execution)")
    parser.add_argument("--backup", action="store_true",
                        help="give fit a BackupAndRestore that never saves inside a block (save_freq=10**9): what "
                             "watching for preemption costs a step")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    steps = args.steps or {"cnn": 15 if args.quick else 40, "mlp": 100 if args.quick else 300}[args.model]
    timeout = args.timeout or (120 if args.quick else 400)
    extra = ((["--tune-malloc"] if args.tune_malloc else []) + (["--batch-hook"] if args.batch_hook else [])
             + (["--backup"] if args.backup else [])
             + ["--model", args.model, "--steps-per-execution", str(args.steps_per_execution)])
    global_batch = {"cnn": 128, "mlp": 64}[args.model]
    what = ("seed CNN, SGD lr 0.01" if args.model == "cnn"
            else "tiny MLP 32-32-10, Adam lr 0.001 epsilon 1e-7 (fit's fused, the hand loop's torch default)")
    print(f"bench_multiworker: {what}, global batch {global_batch} ({global_batch // 2} per worker), 1 torch "
          f"thread per worker, gloo; {rounds} rounds x {steps} steps per variant after 1 warm-up round; fit: "
          f"steps_per_execution={args.steps_per_execution}{', a batch-hook callback' if args.batch_hook else ''}"
          f"{', BackupAndRestore(save_freq=10**9)' if args.backup else ''}",
          flush=True)
    result = C.run_mw_workers("ddp", rounds, steps, extra, timeout)
    r0, r1 = result["ranks"][0], result["ranks"][1]
    wall = r0["times"]["wall"]
    cpu_sum = {name: [a + b for a, b in zip(r0["times"]["cpu"][name], r1["times"]["cpu"][name], strict=True)]
               for name in wall}
    C.print_rounds("wall time, rank 0", wall, ratio_of=("fit2w", "ddp2w", "fit1w", "fit2w"))
    C.print_rounds("CPU time, rank 0 + rank 1", cpu_sum, ratio_of=("fit2w", "ddp2w"))
    print(f"rank 1 CPU while rank 0 ran fit1w alone (should be ~0): median "
          f"{C.median(r1['times']['cpu']['fit1w']):.3f} ms/step")
    print("minor page faults per step, rank 0 (median): " + ", ".join(
        f"{k} {C.median(v):.0f}" for k, v in r0["times"]["faults"].items()))
    print(f"same work check (max weight difference vs fit2w after all blocks): rank 0 "
          f"{r0['weight_diff_vs_fit2w']}, rank 1 {r1['weight_diff_vs_fit2w']}")
    C.summarize({"wall": wall, "cpu": cpu_sum}, "fit2w", "ddp2w", C.TARGET_MULTIWORKER, "2-worker fit/DDP")

    speedups = [one / two for one, two in zip(wall["fit1w"], wall["fit2w"], strict=True)]
    speedup = C.median(speedups)
    print(f"RESULT throughput: 1 worker {global_batch / C.median(wall['fit1w']) * 1e3:.0f} examples/s, "
          f"2 workers {global_batch / C.median(wall['fit2w']) * 1e3:.0f} examples/s (medians); "
          f"median per-round 2-worker/1-worker = {speedup:.3f} (ideal 2.0; rounds {C.spread(speedups)}), "
          f"i.e. 1-worker/2-worker = {C.median([1 / s for s in speedups]):.3f} (ideal 0.5)")
    print(f"       context: one gloo all_reduce of the {r0['gradient_floats']:,} gradient floats takes "
          f"{r0['allreduce_ms']:.1f} ms here (rank 0, median), on top of the halved compute")
    ddp_speedups = [one / two for one, two in zip(wall["fit1w"], wall["ddp2w"], strict=True)]
    print(f"       for reference, hand DDP 2-worker/1-worker fit = {C.median(ddp_speedups):.3f}")


if __name__ == "__main__":
    main()
