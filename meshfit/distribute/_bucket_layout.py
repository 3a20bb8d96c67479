"""DDP's gradient buckets in one layout for a whole run: a resumed run reduces as one never stopped.

DDP copies the gradients into flat buckets and all-reduces each bucket. The all-reduce (gloo's ring,
NCCL's) adds an element's replicas in an order set by where the element lies in its bucket, and with
more than 2 replicas that order changes the bits: float addition is not associative
(``(a + b) + (c + d) != ((a + b) + c) + d``). DDP lays its buckets out once when it is built, and
again after its first backward (by the order the gradients were ready); a resumed run builds a new
wrapper, so its first steps would reduce in the other layout and end a few ulp from the run never
stopped. With 2 replicas every layout gives the same sum (``a + b == b + a``): DDP is left as it is.

With more than 2 replicas each wrapper is built over `LastFirst` (the parameters listed last first,
which is about the order their gradients are ready in the backward) and `fix_layout` lays its
buckets out at once by that list with DDP's size limits, for good: DDP's first bucket (1 MiB) holds
the last layers, whose gradients are ready first, so the all-reduce still overlaps the backward. A
wrapper that searches for unused parameters keeps its first layout (DDP never lays it out again),
which holds the same buckets, reduced in the opposite order.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel


class LastFirst(nn.Module):
    """``module`` with its trainable parameters listed last first (the list DDP buckets by); its
    forward is ``module``'s. The parameters are ``module``'s own (registered twice, not copied)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        order = nn.Module()
        trainable = [p for p in module.parameters() if p.requires_grad]  # a shared parameter once
        for index, param in enumerate(reversed(trainable)):
            order.register_parameter(f"p{index}", param)
        self.order = order  # listed first: DDP keeps a parameter's first occurrence
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def fixes_layout(replicas: int) -> bool:
    """Whether DDP's bucket layout must be fixed for the run to resume bitwise: more than 2 replicas."""
    return replicas > 2


def bucketed(module: nn.Module, replicas: int) -> nn.Module:
    """The module to give DDP: `LastFirst` where the layout is fixed, else ``module`` itself."""
    return LastFirst(module) if fixes_layout(replicas) else module


def fix_layout(ddp: DistributedDataParallel, replicas: int) -> None:
    """Lay ``ddp``'s buckets out now, by its parameters' list, for the rest of the run (more than 2
    replicas; a wrapper that searches for unused parameters already keeps its layout)."""
    if not fixes_layout(replicas):
        return
    ddp.reducer._push_all_rebuilt_params()  # every parameter, as if ready in the list's order
    ddp.reducer._rebuild_buckets()  # one broadcast: every replica takes rank 0's layout
