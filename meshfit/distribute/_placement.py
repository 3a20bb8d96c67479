"""`Placement`: a module placed by a strategy, with the `GradientSync` that owns its gradients.

``strategy.setup_module(module)`` returns a `Placement`; the loop runs the training forward through
``placement.module``, weights and state dicts are read from ``placement.source`` (the user's module),
and ``placement.gradient_sync`` answers for the gradients its wrapper reduced (`gradient_reduced`,
the one question an optimizer step asks), so that the step reduces only the others. A placement
is built by a `PlacementPlan`: transforms applied in order, then the gradient sync that remains; only
the plan builder (`meshfit.distribute._plan_builder`) constructs plans and placements.

Five ways gradients are kept in sync, each a `GradientSync`:

Implementations (`meshfit.distribute._gradient_sync`):

- `ReplicatedSync` (no wrapper: one process, or custom loops over modules created in a scope): the
  optimizer step sums the gradients of the parameters recorded in a strategy's scope across its
  replicas (TF's ``apply_gradients`` semantics; `synchronize_gradients`).
- `DataParallelSync` (``DistributedDataParallel``): DDP's bucketed all-reduce during backward,
  through meshfit's batch-weighting hook. Inside ``fit`` a replica's gradient counts by its share of
  the global batch (``weighting``), which is DDP's average for even batches. Outside ``fit`` (a custom
  loop calling a compiled model) the forward bypasses the wrapper (`Placement.in_step`) and the
  optimizer step sums the gradients, as TF's custom loops do with ``compute_average_loss``.
  A forward through the wrapper records its parameters as reduced, so no optimizer reduces them twice.
- layouts (DTensor parameters, `meshfit.dtensor`): their placements say how each gradient is reduced
  (`ReplicatedSync` reduces a DTensor gradient by its layout).

- tensor parallel with weights replicated over the data axis (`meshfit.dtensor._data_axis_sync.DataAxisSync`,
  a plain map's tensor-parallel keys): one all-reduce over the data axis at the end of the backward.
- fully sharded (`meshfit.dtensor._fully_sharded.FullyShardedSync`, ``LayoutMap.fully_sharded``):
  torch's ``fully_shard`` reduce-scatters the gradients in the backward, weighted as DDP's hook does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import nn

from meshfit._protocols import Residency, StepRunner
from meshfit.distribute._residency import EVERYWHERE

# Both registries are keyed by ``id(param)`` and hold no weak reference to a parameter: torch cannot
# swap a tensor that has one (``module.to(...)`` on DTensor or ``fully_shard`` parameters uses
# ``torch.utils.swap_tensors``, which keeps the Python object and so its id).
#
# Parameters whose gradient a reducer outside any placement (the Estimator's averaging) reduced in the
# current step; the next optimizer step takes the mark instead of reducing again. The value is the
# parameter itself, held until that step, so that an id cannot be reused meanwhile.
_REDUCED_ONCE: dict[int, torch.Tensor] = {}
# Each placed parameter's `GradientSync` (the last transform of its placement's plan), by weak reference:
# a sync lives as long as its placement, whose module holds the parameters, and its entries go with it.
# A plain dict of references: `gradient_reduced`, asked for every parameter at every optimizer step,
# is then two lookups in C (a WeakValueDictionary answers in Python).
_SYNC_OF: dict[int, weakref.ReferenceType[GradientSync]] = {}


def mark_reduced(params: Iterable[torch.Tensor]) -> None:
    """Tell the next optimizer step that these gradients were already reduced across replicas."""
    for p in params:
        _REDUCED_ONCE[id(p)] = p


def register_placement(params: Iterable[torch.Tensor], sync: GradientSync) -> None:
    """Record that ``sync`` owns the gradients of ``params`` (what a plan's last transform does)."""
    ref = weakref.ref(sync, _forget)
    for p in params:
        _SYNC_OF[id(p)] = ref


def _forget(ref: weakref.ReferenceType[GradientSync]) -> None:
    """A sync was freed: drop its parameters' entries (not those a later placement took over)."""
    for key in [key for key, value in _SYNC_OF.items() if value is ref]:
        del _SYNC_OF[key]


def gradient_reduced(param: torch.Tensor) -> bool:
    """The one question an optimizer step asks: was ``param``'s gradient already reduced this step?

    Its placement's `GradientSync` answers (fully sharded: always, in the backward; DDP: when the
    step's forward went through the wrapper); a one-off `mark_reduced` answers once.
    """
    key = id(param)
    ref = _SYNC_OF.get(key)
    if ref is not None:
        sync = ref()
        if sync is not None and sync.reduced(param):
            return True
    return _REDUCED_ONCE.pop(key, None) is param


take_reduced = gradient_reduced  # the former name (the same function: no extra call at every step)


class GradientSync(Protocol):
    """How a placement's gradients reach every replica.

    An optimizer step holds parameters, not placements (one optimizer may train several models'
    parameters): it asks each parameter. A placement whose wrapper reduced a gradient in the backward
    marks the parameter (`mark_reduced`); the step's `synchronize_gradients` reduces every gradient not
    marked, by the strategy whose scope created the parameter (or its DTensor layout).
    """

    def weighting(self, local_size: int, global_size: int) -> contextlib.AbstractContextManager[None]:
        """Inside ``fit``'s step: a replica's gradient counts by its share of the global batch."""
        ...

    def in_step(self) -> bool:
        """Whether a step of ``fit`` is running (its forward goes through the placement's wrapper)."""
        ...

    def reduced(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s current gradient was reduced by the placement (asked once per step)."""
        ...

    def deferred(self) -> contextlib.AbstractContextManager[None]:
        """A step whose gradients stay on this replica, added to the next step's (a batch of a gradient
        accumulation window before its last): DDP's ``no_sync``; a sync that reduces in the optimizer
        step needs nothing (the step does not reduce then); fully sharded reduce-scatters anyway."""
        ...


class Transform(Protocol):
    """One step of a `PlacementPlan`: changes a module in place (or wraps it) and returns it."""

    name: str

    def apply(self, module: nn.Module) -> nn.Module: ...


@dataclasses.dataclass
class PlacementPlan:
    """A model's placement as transforms applied in order, then the gradient sync that remains.

    For a 2-D mesh: tensor-parallel layouts over ``model``, then ``fully_shard`` over ``batch``, then
    the sync (none remains: FSDP reduced every gradient in the backward). `apply` runs the transforms
    and registers every resulting parameter with ``gradient_sync``: an optimizer step then asks
    `gradient_reduced` (the plan's one question) instead of reading tags on parameters.
    """

    transforms: list[Transform]
    gradient_sync: GradientSync
    residency: Residency = EVERYWHERE
    step: StepRunner | None = None

    def apply(self, module: nn.Module) -> Placement:
        source = module
        for transform in self.transforms:
            module = transform.apply(module)
        # A runner of its own (a pipeline's schedule) reduces every gradient there is, also of a weight frozen
        # now and unfrozen later; a DDP wrapper reduces those it was built with (the trainable ones).
        register_placement((p for p in module.parameters() if p.requires_grad or self.step is not None),
                           self.gradient_sync)
        return Placement(module, source, self.gradient_sync, self.residency, self.step)

    def describe(self) -> list[str]:
        """The transforms' names, in the order they run (for messages and tests)."""
        return [t.name for t in self.transforms]


@dataclasses.dataclass(frozen=True)
class Placement:
    """A module as a strategy placed it.

    Args:
        module: what runs the training forward (a DDP wrapper, the laid-out module, or the module).
        source: the user's module, whose parameters are the ones trained and saved.
        gradient_sync: how the gradients of ``source``'s parameters reach every replica.
        residency: which ranks hold which state and the outputs (`EVERYWHERE`: every rank, all).
        step: the runner of a step; None: the model's own forward → loss → backward on ``module``.
    """

    module: nn.Module
    source: nn.Module
    gradient_sync: GradientSync
    residency: Residency = EVERYWHERE
    step: StepRunner | None = None

    def in_step(self) -> bool:
        """Whether ``module`` (rather than ``source``) runs the training forward now: inside a step of
        ``fit``. A custom loop runs ``source``, and its optimizer sums the gradients (TF's contract)."""
        return self.gradient_sync.in_step()

    def state_dict(self) -> dict[str, Any]:
        """The state of the user's module (never the wrapper's prefixed names)."""
        return self.source.state_dict()


class PlacementHook:
    """A forward hook of a strategy's placement: it moves inputs and outputs and changes no math, so
    saving describes the module as its plain layers. Subclass it, or wrap a function with `placement_hook`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


class _FunctionHook(PlacementHook):
    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)


def placement_hook(function: Callable[..., Any]) -> PlacementHook:
    """``function`` as a `PlacementHook` (register the result with torch)."""
    return _FunctionHook(function)
