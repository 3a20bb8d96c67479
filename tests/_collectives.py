"""Counting a process's control collectives (flags, agreement, objects) in tests of what a step sends.

DDP's gradient buckets travel on the device plane: its communication hook's all-reduces are not counted.
"""

from __future__ import annotations

import traceback

import torch.distributed as dist

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_object", "broadcast_object_list",
               "barrier", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "gather_object")


def count_collectives() -> list[int]:
    """Count this process's calls of :data:`COLLECTIVES` from now on, in the one-element list returned.

    The functions of ``torch.distributed`` are replaced for the rest of the process: call it in a
    process of the test's own (a rank of ``run_distributed``).
    """
    counts = [0]
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            if not any("ddp_comm_hooks" in frame.filename for frame in traceback.extract_stack(limit=6)):
                counts[0] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return counts
