"""2-worker ``fit`` with ``gradient_accumulation_steps=4`` vs a hand-written DDP loop that accumulates
under ``no_sync`` (one all-reduce per 4 batches).

Issue target: fitacc / ddpacc <= 1.05 (median of per-round ratios of rank 0's wall time per step).

The driver starts 2 default worker processes of ``bench/_mw_worker.py --mode accumulate`` with a
``TF_CONFIG`` each (free localhost ports, one torch thread each, killed at the end), as
bench_multiworker.py does. Each worker builds ``MultiWorkerMirroredStrategy()`` and then, per round,
runs one block of ``--steps`` batches of each variant between two ``dist.barrier()`` calls (order
reversed every other round; one warm-up round):

- fitacc: ``model.fit(dataset, steps_per_epoch=S, epochs=1, verbose=0)`` with
  ``SGD(0.01, gradient_accumulation_steps=4)``, the seed CNN, the global batch 128 split by the
  strategy (64 rows per worker);
- ddpacc: ``DistributedDataParallel`` of its own copy of the model on the same process group, its 64
  rows of the same global batches: ``(loss / 4).backward()`` under ``ddp.no_sync()`` for 3 batches,
  synced on the 4th, then ``step`` and ``zero_grad``.

Both train the same weights on the same batches; the largest weight difference at the end is printed
(float rounding only: fit divides the summed gradient by 4, the hand loop each loss).

Run:  .venv/bin/python bench/bench_accumulation.py [--quick] [--rounds R] [--steps S]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short smoke run (3 rounds of 16 steps)")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 7; quick 3)")
    parser.add_argument("--steps", type=int, default=None, help="batches per block, a multiple of 4 "
                                                                 "(default 40; quick 16)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before the workers are killed")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    steps = args.steps or (16 if args.quick else 40)
    if steps % 4:
        parser.error(f"--steps must be a multiple of 4 (the accumulation window), received {steps}")
    timeout = args.timeout or (120 if args.quick else 400)

    print(f"bench_accumulation: seed CNN, global batch 128 (64 per worker), SGD lr 0.01, an update every 4 "
          f"batches, 1 torch thread per worker, gloo; {rounds} rounds x {steps} batches per variant after 1 "
          "warm-up round", flush=True)
    result = C.run_mw_workers("accumulate", rounds, steps, [], timeout)
    r0, r1 = result["ranks"][0], result["ranks"][1]
    wall = r0["times"]["wall"]
    cpu_sum = {name: [a + b for a, b in zip(r0["times"]["cpu"][name], r1["times"]["cpu"][name], strict=True)]
               for name in wall}
    C.print_rounds("wall time, rank 0", wall, ratio_of=("fitacc", "ddpacc"))
    C.print_rounds("CPU time, rank 0 + rank 1", cpu_sum, ratio_of=("fitacc", "ddpacc"))
    print(f"same work check (max weight difference vs fitacc after all blocks): rank 0 "
          f"{r0['weight_diff_vs_fitacc']}, rank 1 {r1['weight_diff_vs_fitacc']}")
    C.summarize({"wall": wall, "cpu": cpu_sum}, "fitacc", "ddpacc", C.TARGET_MULTIWORKER,
                "2-worker fit(gradient_accumulation_steps=4)/DDP no_sync loop")


if __name__ == "__main__":
    main()
