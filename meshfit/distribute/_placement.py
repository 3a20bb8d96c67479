"""`Placement`: a module placed by a strategy, with the `GradientSync` that owns its gradients.

``strategy.setup_module(module)`` returns a `Placement`; the loop runs the training forward through
``placement.module``, weights and state dicts are read from ``placement.source`` (the user's module),
and ``placement.gradient_sync`` marks the gradients its wrapper reduced, so that an optimizer step
reduces only the others.

Four ways gradients are kept in sync, each a `GradientSync`:

Implementations (`meshfit.distribute._gradient_sync`):

- `ReplicatedSync` (no wrapper: one process, or custom loops over modules created in a scope): the
  optimizer step sums the gradients of the parameters recorded in a strategy's scope across its
  replicas (TF's ``apply_gradients`` semantics; `synchronize_gradients`).
- `DataParallelSync` (``DistributedDataParallel``): DDP's bucketed all-reduce during backward,
  through meshfit's batch-weighting hook. Inside ``fit`` a replica's gradient counts by its share of
  the global batch (``weighting``), which is DDP's average for even batches. Outside ``fit`` (a custom
  loop calling a compiled model) the forward bypasses the wrapper (`Placement.in_step`) and the
  optimizer step sums the gradients, as TF's custom loops do with ``compute_average_loss``.
  A forward through the wrapper marks its parameters as reduced, so no optimizer reduces them twice.
- layouts (DTensor parameters, `meshfit.dtensor`): their placements say how each gradient is reduced
  (`ReplicatedSync` reduces a DTensor gradient by its layout).

- fully sharded (`meshfit.dtensor._fully_sharded.FullyShardedSync`, ``LayoutMap.fully_sharded``):
  torch's ``fully_shard`` reduce-scatters the gradients in the backward, weighted as DDP's hook does.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn

# Set on a parameter whose gradient a reducer (DDP's backward, the Estimator's averaging) reduced in
# the current step; the next optimizer step clears it instead of reducing again. On the tensor itself:
# any optimizer, the user's own too, sees it, and nothing global remembers parameters.
_REDUCED = "_meshfit_gradient_reduced"


def mark_reduced(params: Iterable[torch.Tensor]) -> None:
    """Tell the next optimizer step that these gradients were already reduced across replicas."""
    for p in params:
        setattr(p, _REDUCED, True)


def take_reduced(param: torch.Tensor) -> bool:
    """Whether ``param``'s gradient was reduced this step (and clear the mark)."""
    if getattr(param, _REDUCED, False):
        setattr(param, _REDUCED, False)
        return True
    return False


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


@dataclasses.dataclass(frozen=True)
class Placement:
    """A module as a strategy placed it.

    Args:
        module: what runs the training forward (a DDP wrapper, the laid-out module, or the module).
        source: the user's module, whose parameters are the ones trained and saved.
        gradient_sync: how the gradients of ``source``'s parameters reach every replica.
    """

    module: nn.Module
    source: nn.Module
    gradient_sync: GradientSync

    def in_step(self) -> bool:
        """Whether ``module`` (rather than ``source``) runs the training forward now: inside a step of
        ``fit``. A custom loop runs ``source``, and its optimizer sums the gradients (TF's contract)."""
        return self.gradient_sync.in_step()

    def state_dict(self) -> dict[str, Any]:
        """The state of the user's module (never the wrapper's prefixed names)."""
        return self.source.state_dict()
