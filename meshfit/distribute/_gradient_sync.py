"""The `GradientSync` implementations: replicated parameters (custom loops) and DDP (see `Placement`)."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any

import torch
from torch import nn

from meshfit.distribute._gradient_weight import GradientWeight, scale_accumulated_gradients
from meshfit.distribute._placement import register_placement


class ReplicatedSync:
    """Gradients summed by the optimizer step over the replicas of the parameters' scope strategy."""

    def weighting(self, local_size: int, global_size: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def in_step(self) -> bool:
        return True  # no wrapper: the module itself runs every forward

    def reduced(self, param: torch.Tensor) -> bool:
        return False  # the optimizer step sums the gradients (TF's apply_gradients)

    def deferred(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # an accumulating optimizer step does not sum (once per update)


@dataclasses.dataclass
class DataParallelSync(ReplicatedSync):
    """DDP's all-reduce, each replica's gradient weighted by its batch share; see `GradientWeight`."""

    weight: GradientWeight
    replicas: int
    # The parameters whose gradient the wrapper reduces in this step, by id, until the optimizer step asks
    # (`reduced`): a plain dict filled by one C call per forward and emptied by one per parameter.
    _marks: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict, repr=False)
    _wrapper: Any = dataclasses.field(default=None, repr=False)  # a weak reference to the DDP wrapper

    def install(self, wrapper: nn.Module) -> None:
        """Whenever the wrapper runs a training forward: record its parameters as reduced, and on an
        uneven step have their gradients weighted before DDP's reducer reads them.

        A wrapper with ``add_forward_callback`` (`ProbingDataParallel`) calls it from its own forward;
        any other gets a forward pre-hook (torch's slower call path, with hooks, at every step)."""
        params = [p for p in wrapper.parameters() if p.requires_grad]
        table = {id(p): p for p in params}
        weight, marks = self.weight, self._marks
        self._wrapper = weakref.ref(wrapper)
        register_placement(params, self)

        def before(synced: bool) -> None:
            if synced:
                marks.update(table)
            if weight.factor != 1.0:  # also a step kept local (gradient accumulation)
                scale_accumulated_gradients(weight, params)

        add_callback = getattr(wrapper, "add_forward_callback", None)
        if add_callback is not None:
            add_callback(before)
            return

        def pre_hook(module: nn.Module, args: Any) -> None:
            if torch.is_grad_enabled():
                before(bool(getattr(module, "require_backward_grad_sync", True)))

        wrapper.register_forward_pre_hook(pre_hook)

    def reduced(self, param: torch.Tensor) -> bool:
        """Whether DDP reduced ``param``'s gradient (a forward through the wrapper since the last step)."""
        return self._marks.pop(id(param), None) is param

    def weighting(self, local_size: int, global_size: int) -> contextlib.AbstractContextManager[None]:
        return self.weighting_of(self.weight, self.replicas, local_size, global_size)

    def in_step(self) -> bool:
        return self.weight.in_step

    def deferred(self) -> contextlib.AbstractContextManager[None]:
        """DDP's ``no_sync``: the backward adds into ``.grad`` without an all-reduce; the next synced
        step all-reduces the sum (once per gradient accumulation window)."""
        wrapper = self._wrapper() if self._wrapper is not None else None
        return wrapper.no_sync() if wrapper is not None else contextlib.nullcontext()

    @staticmethod
    def weighting_of(weight: GradientWeight, replicas: int, local_size: int,
                     global_size: int) -> contextlib.AbstractContextManager[None]:
        """``weight`` set for one step of ``fit``: ``local * replicas / global`` (1.0, DDP's average,
        for an even batch), back to its idle factor after."""
        return _StepWeighting(weight, local_size * replicas / global_size if global_size else 1.0)


class _StepWeighting:
    """`DataParallelSync.weighting_of`'s context, a plain class: entered at every step of ``fit``, where a
    generator-based context manager makes six Python calls more."""

    __slots__ = ("factor", "weight")

    def __init__(self, weight: GradientWeight, factor: float) -> None:
        self.weight, self.factor = weight, factor

    def __enter__(self) -> None:
        self.weight.factor = self.factor
        self.weight.in_step = True

    def __exit__(self, *exc_info: object) -> None:
        self.weight.end_step()
