"""Per-step cost of DDP's unused-parameter search on the seed CNN, 2 gloo workers, one thread each.

Variants, rounds interleaved in the same two processes: plain DDP (``find_unused_parameters=False``),
DDP with the search on every step (``True``), and meshfit's `ProbingDataParallel` (``static_graph`` on the
first step, then plain DDP when every parameter got a gradient). A step is forward, loss, backward, SGD
step, ``zero_grad(set_to_none=True)``. Prints the median ms/step of each variant (rank 0).

    PYTHONPATH=. python bench/bench_unused_parameters.py [--steps 40] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from _multiproc import run_distributed  # type: ignore[import-not-found]  # noqa: E402

from meshfit.distribute._unused_parameters import ProbingDataParallel  # noqa: E402


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Unflatten(1, (1, 28)), nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(26 * 26 * 32, 128), nn.ReLU(), nn.Linear(128, 10))


def _everywhere(flag: bool) -> bool:
    summed = torch.tensor([int(flag)])
    torch.distributed.all_reduce(summed)
    return int(summed.item()) == torch.distributed.get_world_size()


def _wrap(variant: str, module: nn.Module) -> nn.Module:
    if variant == "probing":
        return ProbingDataParallel(module, lambda bucketed, find, static: DistributedDataParallel(
            bucketed, gradient_as_bucket_view=True, find_unused_parameters=find, static_graph=static), _everywhere,
            torch.distributed.get_world_size())
    return DistributedDataParallel(module, gradient_as_bucket_view=True,
                                   find_unused_parameters=variant == "find_unused")


def _worker(rank: int, world: int, steps: int, rounds: int) -> dict[str, list[float]]:
    x, y = torch.randn(64, 28, 28), torch.randint(0, 10, (64,))
    times: dict[str, list[float]] = {"plain": [], "find_unused": [], "probing": []}
    for _ in range(rounds):
        for variant in times:
            model = _wrap(variant, _cnn())
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            for step in range(steps + 5):
                if step == 5:
                    start = time.perf_counter()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            times[variant].append((time.perf_counter() - start) / steps * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    times = run_distributed(_worker, world_size=2, args=(args.steps, args.rounds), timeout=600)[0]
    plain = statistics.median(times["plain"])
    for variant, values in times.items():
        median = statistics.median(values)
        print(f"{variant:12s} {median:7.2f} ms/step (rounds: {', '.join(f'{v:.2f}' for v in values)}); "
              f"{median / plain:.3f}x plain")


if __name__ == "__main__":
    main()
