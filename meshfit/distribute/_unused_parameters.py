"""`ProbingDataParallel`: DDP that looks for unused parameters only in a model that has them.

A parameter that gets no gradient in a step (an unused layer, a branch not taken) is left unchanged
by one process (its gradient stays None; the optimizer skips it, Adam's moments included). Plain DDP
(``find_unused_parameters=False``) instead never finishes that step's reduction and stops at the next
forward ("Expected to have finished reduction in the prior iteration"). ``find_unused_parameters=True``
handles it as one process does (a parameter no replica used keeps a None gradient; one that some
replicas used gets their average), but walks the autograd graph and all-reduces a used-parameter map
every step.

So the first training step runs under DDP's ``static_graph=True`` (whose first iteration finds the
unused parameters once, as the search does, and says nothing when there are none) and records which
parameters got a gradient on this replica. At the next training forward the replicas agree (one MIN
all-reduce on the control plane) and the module is re-wrapped: without the search if every parameter got a gradient
everywhere (later steps cost what plain DDP costs), else with ``find_unused_parameters=True`` for the
rest of the run (a branch taken on some steps only, or on some replicas only, then works too). A model whose every parameter was used on
the first step but not on a later one is refused with the fix (`UnusedParameterError`).

A gradient accumulation step that stays local (`no_sync`, a batch of a window before its last) runs
the module itself, outside DDP: its gradients add into ``.grad`` with no collective at all (DDP's own
``no_sync`` still broadcasts buffers every forward, and refuses to start a static graph's first step
there); the window's last step all-reduces the sum through the wrapper.

With more than 2 replicas every wrapper reduces in one bucket layout from its first step on, the
same for the first step's wrapper and the next, so that a resumed run adds the replicas' gradients
in the order a run never stopped did (`meshfit.distribute._bucket_layout`).
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshfit.distribute._bucket_layout import bucketed, fix_layout

_UNFINISHED = "Expected to have finished reduction in the prior iteration"


class UnusedParameterError(RuntimeError):
    """A parameter got no gradient on a step after a first step in which every parameter got one."""


class ProbingDataParallel(nn.Module):
    """``build``'s DDP wrapper of ``module``, searching for unused parameters only where needed.

    Args:
        module: the module to train (placed on its device, compiled if asked).
        build: makes the DDP wrapper (with its communication hook) of the module it is given, for
            ``find_unused_parameters`` and ``static_graph`` (the first step's).
        everywhere: whether a flag holds on every replica (one all-reduce of a CPU tensor on the
            strategy's control plane: no device round trip).
        replicas: the size of the wrapper's process group (more than 2: one bucket layout for the run).
    """

    # The current wrapper as a plain attribute too, read at every step without nn.Module.__getattr__ (a
    # Python call for a submodule); ``wrapped`` keeps it a submodule (train/eval, ``modules()``).
    _ddp: DistributedDataParallel

    def __init__(self, module: nn.Module, build: Callable[[nn.Module, bool, bool], DistributedDataParallel],
                 everywhere: Callable[[bool], bool], replicas: int) -> None:
        super().__init__()
        self._build = build
        self._everywhere = everywhere
        self._replicas = replicas
        self._callbacks: list[Callable[[bool], None]] = []
        self.wrapped = self._wrap(bucketed(module, replicas), False, True)
        self._params = [p for p in self.wrapped.module.parameters() if p.requires_grad]
        self._used: set[int] = set()
        self._handles: list[Any] | None = [
            p.register_post_accumulate_grad_hook(self._record) for p in self._params]
        self._probed = False  # a training forward ran with the hooks on; decide at the next one
        self._local = False  # inside `no_sync`: forwards run the module itself

    @property
    def find_unused_parameters(self) -> bool:
        """Whether the wrapper now searches the graph for unused parameters every step."""
        return bool(self.wrapped.find_unused_parameters) and not self.wrapped.static_graph

    @property
    def require_backward_grad_sync(self) -> bool:
        return not self._local and bool(self.wrapped.require_backward_grad_sync)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards inside run the module itself: their gradients add into ``.grad`` on this replica
        alone, and the next forward through the wrapper's backward all-reduces the sum."""
        local, self._local = self._local, True
        try:
            yield
        finally:
            self._local = local

    def add_forward_callback(self, callback: Callable[[bool], None]) -> None:
        """Call ``callback(synced)`` at each forward with gradients on, before the module runs: ``synced``
        is False for a forward kept on this replica (`no_sync`). What a forward pre-hook would do, without
        torch's call path for modules with hooks at every step."""
        self._callbacks.append(callback)

    def _record(self, param: torch.Tensor) -> None:
        if not self._local:  # a batch that stays on this replica (accumulation) is not what the wrapper runs
            self._used.add(id(param))

    def _decide(self) -> None:
        """After the first step: search every step only if some replica left a parameter unused."""
        handles, self._handles = self._handles, None
        for handle in handles or []:
            handle.remove()
        all_used = self._everywhere(len(self._used) == len(self._params))
        self._used.clear()
        # The first step's wrapper goes, and its reducer's autograd hooks with it. Both are normally freed
        # here; only one kept by a reference cycle needs a collection of the whole heap (0.2-0.3 s of CPU
        # in a process that imported torch, paid by every fit).
        module = self.wrapped.module  # the same module (or `LastFirst`) under the next wrapper
        left = [weakref.ref(self.wrapped), weakref.ref(self.wrapped.reducer)]
        self.wrapped = None  # type: ignore[assignment]
        object.__setattr__(self, "_ddp", None)
        if any(ref() is not None for ref in left):
            gc.collect()
        self.wrapped = self._wrap(module, not all_used, False)

    def _wrap(self, module: nn.Module, find_unused: bool, static_graph: bool) -> DistributedDataParallel:
        ddp = self._build(module, find_unused, static_graph)
        fix_layout(ddp, self._replicas)
        object.__setattr__(self, "_ddp", ddp)  # see `_ddp`
        return ddp

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # The first training forward after the first step decides (before the wrapper is read here: the
        # first step's one is freed there).
        if self._handles is not None and self._probed and self.require_backward_grad_sync and torch.is_grad_enabled():
            self._decide()
        ddp = self._ddp
        if not torch.is_grad_enabled():
            return ddp.module(*args, **kwargs) if self._local else ddp(*args, **kwargs)
        if self._local:
            for callback in self._callbacks:
                callback(False)
            return ddp.module(*args, **kwargs)
        training = ddp.require_backward_grad_sync
        for callback in self._callbacks:
            callback(training)
        try:
            output = ddp(*args, **kwargs)
        except RuntimeError as error:
            if _UNFINISHED not in str(error) or self.find_unused_parameters:
                raise
            raise UnusedParameterError(
                "A parameter got no gradient in the last training step, but every parameter got one on the "
                "first step, so the replicas stopped looking for unused parameters. Make the first step use "
                "the same parameters as the others, or freeze the parameters that are not trained "
                "(`requires_grad_(False)`).") from error
        if training:
            self._probed = True
        return output
