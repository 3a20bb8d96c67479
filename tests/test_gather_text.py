"""`all_gather_text`: every rank's string by rank, in one all-gather when each fits the capacity.

A save agrees three texts across the ranks (the digests, and the chief's outcome twice); each is one
collective, and a text longer than the capacity takes a second one.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from _multiproc import run_distributed

from meshfit.train import _storage

CAPACITY = _storage._TEXT_CAPACITY


def _texts(rank: int) -> list[str]:
    return [
        f"rank {rank}",
        "" if rank == 0 else "ok",  # an empty text beside a short one
        "é€😀" * (rank + 1),  # multi-byte characters
        "x" * CAPACITY if rank == 0 else "y" * (CAPACITY - 1),  # at the capacity: still one collective
        "a" * (CAPACITY + 3) if rank == 1 else "short",  # one longer than the capacity
        "b" * (3 * CAPACITY + 5) + str(rank),  # every one longer
        "",
    ]


def _worker(rank: int, size: int) -> list[tuple[list[str], int]]:
    calls = [0]
    original = dist.all_gather

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    dist.all_gather = counting
    out = []
    try:
        for text in _texts(rank):
            before = calls[0]
            out.append((_storage.all_gather_text(text, None), calls[0] - before))
    finally:
        dist.all_gather = original
    return out


@pytest.mark.timeout(120)
def test_every_rank_gets_every_text_in_one_collective_unless_one_is_longer_than_the_capacity():
    results = run_distributed(_worker, 2, timeout=90)
    expected = [[_texts(0)[i], _texts(1)[i]] for i in range(len(_texts(0)))]
    collectives = [1, 1, 1, 1, 2, 2, 1]
    for rank, result in enumerate(results):
        assert [texts for texts, _ in result] == expected, rank
        assert [count for _, count in result] == collectives, rank
