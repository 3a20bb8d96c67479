"""Gradient accumulation, Keras 3's ``gradient_accumulation_steps``: one update every N batches.

Keras 3 (``BaseOptimizer._backend_apply_gradients``) counts every batch in its ``_iterations``
variable, applies the update on the batch where ``(_iterations + 1) % N == 0`` with the mean of the
N batches' gradients (clipping and weight decay apply to that mean), and reports
``optimizer.iterations`` as the updates, ``_iterations // N``; learning-rate schedules read the
batch count. meshfit keeps those numbers and does the accumulation the torch way: a batch's gradient
adds into each parameter's ``.grad`` (``backward`` accumulates, and a ``zero_grad`` inside a window
keeps them), and the update divides the sum by N. Under data parallel the batches before the update
run under DDP's ``no_sync`` (see `meshfit.distribute.GradientSync.deferred`), so the replicas
all-reduce once per update.

The sums inside a window differ between replicas (each adds its own batches), so a backup holds
them per rank (`AccumulatedGradients`, in the loop's replica state), never in the optimizer's
shared state.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from meshfit._validation import is_int


def check_accumulation_steps(value: Any) -> int | None:
    """``value`` if it is None or an int >= 1 (1: every batch is an update, as without it)."""
    if value is None:
        return None
    if not is_int(value) or value < 1:
        raise ValueError("Invalid `gradient_accumulation_steps`: expected None or an int >= 1 (the number of "
                         f"batches whose mean gradient makes one update), received gradient_accumulation_steps="
                         f"{value!r}. Pass e.g. gradient_accumulation_steps=4, or None to update at every batch.")
    return int(value)


def defers_update(optimizer: Any) -> bool:
    """Whether ``optimizer``'s next step only accumulates (a batch inside a window, before its last).

    Duck-typed: any object without the meshfit optimizer's counters (a torch optimizer, None) updates
    at every step.
    """
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if not steps or steps == 1:
        return False
    return (int(optimizer.batches) + 1) % steps != 0


def inside_window(optimizer: Any) -> bool:
    """Whether ``optimizer`` holds gradients summed over a window that has not ended (its last step
    only counted): the batches stepped over are not a multiple of ``gradient_accumulation_steps``."""
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if not steps or steps == 1:
        return False
    return int(optimizer.batches) % steps != 0


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a fully sharded gradient), or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


class AccumulatedGradients:
    """The gradients summed so far in the current window, as this rank holds them (a ``Stateful``).

    ``state_dict()`` holds each parameter's ``.grad`` by its index in the optimizer (this rank's shard
    of a fully sharded one), only inside a window, and the number of processes that summed them;
    ``load_state_dict`` puts them back as the parameters' ``.grad`` (None where none was saved), so the
    next batches add onto them. Sums saved by another number of processes cannot be split again: they
    are dropped with a warning (the window's update then holds its later batches only).

    Args:
        optimizer: a built meshfit `Optimizer` with ``gradient_accumulation_steps``.
        processes: the processes training now (each holds its own sums).
    """

    def __init__(self, optimizer: Any, processes: int = 1) -> None:
        self._optimizer = optimizer
        self._processes = processes

    def state_dict(self) -> dict[str, Any]:
        optimizer = self._optimizer
        steps = optimizer.gradient_accumulation_steps
        if not steps or optimizer.batches % steps == 0:  # at a window's start nothing is held
            return {"processes": self._processes, "sums": {}}
        sums = {str(i): _local(p.grad).detach() for i, p in enumerate(optimizer._params()) if p.grad is not None}
        return {"processes": self._processes, "sums": sums}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        params = self._optimizer._params()
        sums = state["sums"]
        if sums and int(state["processes"]) != self._processes:
            warnings.warn(f"The backup was taken inside a gradient accumulation window by {state['processes']} "
                          f"processes; {self._processes} resume it, so the window's gradient sums are dropped and "
                          "its update holds its later batches only. Resume on as many processes, or from a backup "
                          "at a window's end, for an exact resume.", stacklevel=2)
            sums = {}
        unknown = [key for key in sums if not key.isdigit() or int(key) >= len(params)]
        if unknown:
            raise ValueError(f"The backup's accumulated gradients name parameter {unknown[0]!r}, but the optimizer "
                             f"has {len(params)} parameters: resume with the model and optimizer that made it.")
        for i, param in enumerate(params):
            saved = sums.get(str(i))
            if saved is None:
                param.grad = None
                continue
            grad = torch.zeros_like(param)  # a DTensor parameter gets a gradient of its own layout
            with torch.no_grad():
                _local(grad).copy_(saved)
            param.grad = grad
