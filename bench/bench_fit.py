"""``Model.fit`` vs a hand-written PyTorch loop: step time of the seed CNN on one process.

Issue target: fit / hand-written <= 1.03 (median of per-round ratios).

Both variants train their own copy of the same (materialised) seed CNN, batch 64, SGD lr 0.01, one
torch thread, on the SAME batches in the same order: the first pass-order of
``Dataset.from_tensor_slices((x, y)).shuffle(n, seed=0).repeat().batch(64)`` over the 28x28 digits.
They alternate in blocks of ``--steps`` steps, one warm-up round then ``--rounds`` measured rounds,
the order flipping every round (A B, B A, ...):

- hand: ``opt.zero_grad(); loss = F.cross_entropy(model(xb), yb); loss.backward(); opt.step()``
  with ``xb, yb = x[idx], y[idx]`` from tensors (``idx``: that dataset's batches, precomputed);
- fit: ``model.fit(dataset.skip(k * S), steps_per_epoch=S, epochs=1, verbose=0)`` for block ``k``,
  compiled with ``metrics=["accuracy"]``: one ``fit`` call per block on a model that persists, so a
  block includes fit's per-call setup (data handler, callbacks, end-of-fit work) amortised over S.
  (``skip`` continues where the last block stopped: every fit call starts its data at batch 0.)

Both models see identical data from identical weights, so they do the same arithmetic; the final
weight difference is printed as a check. Both variants share one default process, as a user's is;
``--tune-malloc`` tunes glibc first (`_common.tune_malloc`): without it, page faults that move
between the two variants can dominate the ratio. ``bench_all.py`` compares separate processes. Times are wall and process CPU time; on a loaded machine the
CPU-time ratio is the steadier estimate of the same thing (the loop is single-threaded).

Run:  .venv/bin/python bench/bench_fit.py [--quick] [--rounds R] [--steps S] [--verbose 1] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import meshfit as mf  # noqa: E402

BATCH = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short smoke run (3 rounds of 20 steps)")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 9; quick 3)")
    parser.add_argument("--steps", type=int, default=None, help="steps per block (default 40; quick 20)")
    parser.add_argument("--verbose", type=int, default=0, choices=(0, 1, 2),
                        help="fit's verbose (default 0); 1/2 print the progress bar to /dev/null")
    parser.add_argument("--tune-malloc", action="store_true",
                        help="mallopt-tune glibc in this process (a user's process is not tuned)")
    parser.add_argument("--profile", action="store_true", help="afterwards, cProfile one fit block")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 9)
    steps = args.steps or (20 if args.quick else 40)
    tuned = C.tune_malloc() if args.tune_malloc else False

    C.quiet_threads()
    torch.manual_seed(0)
    x, y = C.load_train()
    n = len(x)
    x_t, y_t = torch.from_numpy(x), torch.from_numpy(y)
    base = C.materialised_seed_module(x_t[:2])
    dataset = mf.data.Dataset.from_tensor_slices((x, y)).shuffle(n, seed=0).repeat().batch(BATCH)
    blocks = rounds + 1
    index_stream = mf.data.Dataset.from_tensor_slices(np.arange(n)).shuffle(n, seed=0).repeat().batch(BATCH)
    indices = [b.clone() for b in itertools.islice(iter(index_stream), blocks * steps + 1)]
    # A second iterator of one shuffled Dataset reshuffles (as tf.data's reshuffle_each_iteration):
    # check the order on an identical, separate dataset so that fit's first block gets pass 0.
    first = next(iter(mf.data.Dataset.from_tensor_slices((x, y)).shuffle(n, seed=0).repeat().batch(BATCH)))
    assert torch.equal(first[1], y_t[indices[0]]), "the hand loop's batches differ from the dataset's"

    # ---- hand-written loop --------------------------------------------------------------------
    hand = copy.deepcopy(base)
    hand.train()
    opt = torch.optim.SGD(hand.parameters(), lr=0.01)
    hand_blocks = [0]

    def hand_block() -> tuple[float, float, float]:
        batches = indices[hand_blocks[0] * steps:(hand_blocks[0] + 1) * steps]
        hand_blocks[0] += 1
        clock = C.Clock()
        for idx in batches:
            xb, yb = x_t[idx], y_t[idx]
            opt.zero_grad()
            loss = F.cross_entropy(hand(xb), yb)
            loss.backward()
            opt.step()
        return clock.per(steps)

    # ---- meshfit fit ------------------------------------------------------------------------------
    model = mf.Model(copy.deepcopy(base))
    C.compile_seed(model)
    fit_blocks = [0]

    def fit_block() -> tuple[float, float, float]:
        data = dataset.skip(fit_blocks[0] * steps) if fit_blocks[0] else dataset
        fit_blocks[0] += 1
        with open(os.devnull, "w") as devnull:
            redirect = contextlib.redirect_stdout(devnull) if args.verbose else contextlib.nullcontext()
            clock = C.Clock()
            with redirect:
                model.fit(data, steps_per_epoch=steps, epochs=1, verbose=args.verbose)
            return clock.per(steps)

    print(f"bench_fit: seed CNN, {n} digits 28x28, batch {BATCH}, SGD lr 0.01, torch threads "
          f"{torch.get_num_threads()}, fit verbose={args.verbose}, malloc tuned={tuned}; {rounds} rounds "
          f"x {steps} steps per variant after 1 warm-up round (order alternates)", flush=True)
    times = C.interleave({"hand": hand_block, "fit": fit_block}, rounds,
                         on_round=lambda r, warm: print(f"round {r}{' (warm-up)' if warm else ''} done",
                                                        flush=True))
    C.print_rounds("wall time", times["wall"], ratio_of=("fit", "hand"))
    C.print_rounds("CPU time of the process", times["cpu"], ratio_of=("fit", "hand"))
    diff = max((a - b).abs().max().item() for a, b in zip(hand.parameters(), model.module.parameters(), strict=True))
    print(f"same work check: max |hand - fit| weight difference after {blocks * steps} steps each = {diff:.2e}")
    print(f"minor page faults per step (median): hand {C.median(times['faults']['hand']):.0f}, "
          f"fit {C.median(times['faults']['fit']):.0f}")
    C.summarize(times, "fit", "hand", C.TARGET_FIT, "fit/hand")

    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0)
        profiler.disable()
        print(f"\ncProfile of one fit block of {steps} steps (top 30 by internal time):")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
