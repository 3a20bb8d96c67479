"""``Estimator.train`` vs ``Model.fit``: step time of the seed CNN on one process, same model and data.

Issue target: Estimator.train / Model.fit <= 1.05 (median of per-round ratios).

Both variants train their own copy of the same (materialised) seed CNN, batch 64, SGD lr 0.01, one
torch thread, on the same batches: ``Dataset.from_tensor_slices((x, y)).shuffle(n, seed=0).repeat()
.batch(64)`` over the 28x28 digits, block ``k`` of ``S`` steps reading ``dataset.skip(k * S)`` (a dataset object per variant). They
alternate in blocks, one warm-up round then ``--rounds`` measured rounds, the order flipping every round:

- fit: ``model.fit(data, steps_per_epoch=S, epochs=1, verbose=0)``, compiled with the loss only;
- estimator: ``estimator.train(input_fn, steps=S)`` with a ``model_fn`` that calls the module (built
  once, passed in ``params``), computes the same mean cross-entropy and returns
  ``optimizer.minimize(loss)``; ``RunConfig`` without checkpoints or step logs, as fit has none.

Each block includes its call's setup (data, callbacks or hooks) amortised over ``S`` steps. Both do the
same arithmetic: the final weight difference is printed as a check. Times are wall and process CPU
time; on a loaded machine the CPU-time ratio is the steadier estimate (the loop is single-threaded).

Run:  .venv/bin/python bench/bench_estimator.py [--quick] [--rounds R] [--steps S] [--profile]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import meshfit as mf  # noqa: E402

BATCH = 64
TARGET_ESTIMATOR = 1.05


def model_fn(features, labels, mode, params):
    logits = params["module"](features)
    loss = F.cross_entropy(logits, labels)
    return mf.estimator.EstimatorSpec(mode, loss=loss, train_op=params["optimizer"].minimize(loss))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short smoke run (3 rounds of 20 steps)")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 9; quick 3)")
    parser.add_argument("--steps", type=int, default=None, help="steps per block (default 40; quick 20)")
    parser.add_argument("--profile", action="store_true", help="afterwards, cProfile one Estimator block")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 9)
    steps = args.steps or (20 if args.quick else 40)

    C.quiet_threads()
    torch.manual_seed(0)
    x, y = C.load_train()
    base = C.materialised_seed_module(torch.from_numpy(x[:2]))

    def make_dataset() -> mf.data.Dataset:
        # One per variant: each fit/train call on a dataset object starts its next pass (reshuffled).
        return mf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0).repeat().batch(BATCH)

    datasets = {"fit": make_dataset(), "estimator": make_dataset()}

    model = mf.Model(copy.deepcopy(base))
    model.compile(optimizer=mf.optimizers.SGD(learning_rate=0.01),
                  loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    blocks = {"fit": 0, "estimator": 0}

    def fit_block() -> tuple[float, float, float]:
        data = datasets["fit"].skip(blocks["fit"] * steps)
        blocks["fit"] += 1
        clock = C.Clock()
        model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0)
        return clock.per(steps)

    module = copy.deepcopy(base)
    config = mf.estimator.RunConfig(save_checkpoints_steps=None, save_checkpoints_secs=None, log_step_count_steps=None,
                                    save_summary_steps=None)
    estimator = mf.estimator.Estimator(model_fn, model_dir=tempfile.mkdtemp(prefix="bench_estimator_"), config=config,
                                       params={"module": module, "optimizer": mf.optimizers.SGD(learning_rate=0.01)})

    def estimator_block() -> tuple[float, float, float]:
        data = datasets["estimator"].skip(blocks["estimator"] * steps)
        blocks["estimator"] += 1
        clock = C.Clock()
        estimator.train(lambda: data, steps=steps)
        return clock.per(steps)

    print(f"bench_estimator: seed CNN, {len(x)} digits 28x28, batch {BATCH}, SGD lr 0.01, torch threads "
          f"{torch.get_num_threads()}; {rounds} rounds x {steps} steps per variant after 1 warm-up round "
          "(order alternates)", flush=True)
    times = C.interleave({"estimator": estimator_block, "fit": fit_block}, rounds,
                         on_round=lambda r, warm: print(f"round {r}{' (warm-up)' if warm else ''} done", flush=True))
    C.print_rounds("wall time", times["wall"], ratio_of=("estimator", "fit"))
    C.print_rounds("CPU time of the process", times["cpu"], ratio_of=("estimator", "fit"))
    diff = max((a - b).abs().max().item() for a, b in zip(module.parameters(), model.module.parameters(), strict=True))
    print(f"same work check: max |estimator - fit| weight difference after {(rounds + 1) * steps} steps each = "
          f"{diff:.2e}")
    C.summarize(times, "estimator", "fit", TARGET_ESTIMATOR, "estimator/fit")

    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        estimator.train(lambda: make_dataset(), steps=steps)
        profiler.disable()
        print(f"\ncProfile of one Estimator block of {steps} steps (top 30 by internal time):")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
