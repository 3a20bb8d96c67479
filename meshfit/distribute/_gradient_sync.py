"""The `GradientSync` implementations: replicated parameters (custom loops) and DDP (see `Placement`)."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

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
    _reduced: WeakIdKeyDictionary = dataclasses.field(default_factory=WeakIdKeyDictionary, repr=False)
    _wrapper: Any = dataclasses.field(default=None, repr=False)  # a weak reference to the DDP wrapper

    def install(self, wrapper: nn.Module) -> None:
        """Whenever the wrapper runs a training forward: record its parameters as reduced, and on an
        uneven step have their gradients weighted before DDP's reducer reads them."""
        params = [p for p in wrapper.parameters() if p.requires_grad]
        weight, reduced = self.weight, self._reduced
        self._wrapper = weakref.ref(wrapper)
        register_placement(params, self)

        def pre_hook(module: nn.Module, args: Any) -> None:
            if not torch.is_grad_enabled():
                return
            if getattr(module, "require_backward_grad_sync", True):
                for p in params:
                    reduced[p] = True
            scale_accumulated_gradients(weight, params)  # also a step kept local (gradient accumulation)

        wrapper.register_forward_pre_hook(pre_hook)

    def reduced(self, param: torch.Tensor) -> bool:
        """Whether DDP reduced ``param``'s gradient (a forward through the wrapper since the last step)."""
        return bool(self._reduced.pop(param, False))  # type: ignore[no-untyped-call]

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
    @contextlib.contextmanager
    def weighting_of(weight: GradientWeight, replicas: int, local_size: int, global_size: int) -> Iterator[None]:
        """``weight`` set for one step of ``fit``: ``local * replicas / global`` (1.0, DDP's average,
        for an even batch), back to its idle factor after."""
        weight.factor = local_size * replicas / global_size if global_size else 1.0
        weight.in_step = True
        try:
            yield
        finally:
            weight.end_step()
