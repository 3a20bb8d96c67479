"""The contracts of a placement, as ``typing.Protocol``s: how gradients are kept in sync, which ranks
hold which state (`Residency`), and the runner of a step (`StepRunner`). `meshfit._protocols`
re-exports them."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import nn


class GradientSyncLike(Protocol):
    """How a placement's gradients reach every replica (see `meshfit.distribute.GradientSync`)."""

    def weighting(self, local_size: int, global_size: int) -> AbstractContextManager[None]: ...

    def in_step(self) -> bool: ...

    def reduced(self, param: torch.Tensor) -> bool: ...  # the placement reduced this gradient already

    def deferred(self) -> AbstractContextManager[None]: ...  # a step whose gradients stay local (accumulation)


class Residency(Protocol):
    """Who holds what (see the module docstring)."""

    @property
    def everywhere(self) -> bool:
        """Whether every rank holds every path (its copy or shard): SPMD, nothing to complete."""
        ...

    @property
    def holds_outputs(self) -> bool:
        """Whether this rank computes the loss, the metrics and the predictions."""
        ...

    @property
    def leads_logs(self) -> bool | None:
        """Whether this rank sends its replica's metric states in the log reduction; None: the
        strategy's own rule (a replica's first process)."""
        ...

    def holds(self, path: str) -> bool:
        """Whether this rank holds the state at ``path`` (a module path, or ``optimizer/<path>/...``)."""
        ...

    def holders(self, path: str) -> Sequence[int]:
        """The global ranks that hold ``path``, lowest first (empty: every rank)."""
        ...


class StepOutputs(Protocol):
    """What a step runner returns on a rank that holds the outputs: the predictions, the loss of the
    (per-replica) batch, and the batch's size (its number of examples)."""

    y_pred: Any
    loss: torch.Tensor
    size: int


class StepHost(Protocol):
    """The model a step runner runs (a `meshfit.Model`): Keras's step helpers."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def compute_loss(self, x: Any = None, y: Any = None, y_pred: Any = None, sample_weight: Any = None,
                     training: bool = True) -> torch.Tensor: ...

    @property
    def optimizer(self) -> Any: ...  # its ``scale_loss`` gives the loss a backward starts from


class StepRunner(Protocol):
    """How a placement runs forward → loss → backward (``train``), forward → loss (``evaluate``) and
    forward (``predict``) on one batch; ``train_step``, ``test_step`` and ``predict_step`` delegate to it.

    A runner returns the outputs on the ranks its placement's `Residency` says hold them, and None on
    the others (a pipeline's earlier stages). Data parallel, layouts and fully sharded placements have
    none (`Placement.step` is None): the model runs its own local step.
    """

    def train(self, host: StepHost, x: Any, y: Any, sample_weight: Any) -> StepOutputs | None: ...

    def evaluate(self, host: StepHost, x: Any, y: Any, sample_weight: Any) -> StepOutputs | None: ...

    def predict(self, host: StepHost, x: Any) -> Any: ...


@runtime_checkable
class ShapesModule(Protocol):
    """A step runner under which the user's module cannot run whole on one process (a pipeline's other stages'
    weights released, its own sharded or split): it gives a module of the same structure whose forward gives
    the shapes (``model.summary()``'s output shapes)."""

    def shapes_module(self) -> nn.Module: ...


class PlacementLike(Protocol):
    """A module as a strategy placed it (see `meshfit.distribute.Placement`)."""

    @property
    def module(self) -> nn.Module: ...  # what runs the training forward (a wrapper, or the module)

    @property
    def source(self) -> nn.Module: ...  # the user's module: its parameters are trained and saved

    @property
    def gradient_sync(self) -> GradientSyncLike: ...

    @property
    def residency(self) -> Residency: ...  # which ranks hold which state and the outputs

    @property
    def step(self) -> StepRunner | None: ...  # the runner of a step (None: the model's own local step)

    def in_step(self) -> bool: ...

    def state_dict(self) -> dict[str, Any]: ...
