"""How a meshfit optimizer builds, restores and clears its torch optimizer: fused or foreach kernels, lazy
parameters broadcast once materialised, DTensor state placed like its parameter, and whether ``zero_grad``
may set the gradients to None without torch's profiler range."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from meshfit.distribute import broadcast_initial_values, owner_of


def place_state_like_params(optimizer: torch.optim.Optimizer) -> None:
    """Give full-size state tensors their DTensor parameter's layout (a checkpoint restored into a
    fresh optimizer has no state to load into in place, so it arrives as full plain tensors)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for param, state in optimizer.state.items():
        if not isinstance(param, DTensor):
            continue
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
                state[key] = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements,
                                               src_data_rank=None)


def broadcast_lazy_params(params: list[torch.Tensor]) -> None:
    """Rank 0's values of parameters created in a multi-replica scope that were lazy at its exit."""
    by_strategy: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    for p in params:
        strategy = owner_of(p)
        if strategy is not None and strategy.num_replicas_in_sync > 1:
            by_strategy.setdefault(id(strategy), (strategy, []))[1].append(p)
    for strategy, group in by_strategy.values():
        broadcast_initial_values(group, strategy)


def fusable(torch_class: Callable[..., Any], params: list[torch.Tensor]) -> bool:
    """Whether torch's fused kernel can update ``params`` (floating point, on a CPU or a GPU)."""
    if "fused" not in inspect.signature(torch_class).parameters or not params:
        return False
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def accepts_foreach(torch_class: Callable[..., Any]) -> bool:
    """Whether a torch optimizer class takes ``foreach=`` (every built-in one does)."""
    return "foreach" in inspect.signature(torch_class).parameters


#: torch's own ``Optimizer.zero_grad``, as it was when meshfit was imported (a later patch of it is not it).
TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def clears_plainly(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.zero_grad`` is torch's own (neither its class, nor the instance, nor a patch of
    torch's class replaces it): then setting each parameter's ``grad`` to None is all
    ``zero_grad(set_to_none=True)`` does, less the profiler range it opens (kept where a profiler records:
    see `profiling`). Asked at every call: a user may patch ``zero_grad`` any time."""
    return optimizer.__class__.zero_grad is TORCH_ZERO_GRAD and "zero_grad" not in optimizer.__dict__


def profiling() -> bool:
    """Whether a torch profiler records now, on any thread (torch's ranges, such as
    ``Optimizer.zero_grad#Adam.zero_grad``, are then opened as torch opens them). A standalone
    ``ExecutionTraceObserver``, started without a profiler, is not seen: torch keeps no flag for it."""
    return torch.autograd.profiler._is_profiler_enabled or torch._C._autograd._profiler_enabled()
