"""Resolving user loss identifiers: strings, `Loss` instances, torch loss modules and callables."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshfit._serialization import describe, rebuild
from meshfit.losses._crossentropy import (
    BinaryCrossentropy,
    CategoricalCrossentropy,
    SparseCategoricalCrossentropy,
)
from meshfit.losses._losses import (
    Huber,
    Loss,
    MeanAbsoluteError,
    MeanSquaredError,
    as_scores,
    reduce_weighted,
    snake_case,
    to_same_rank,
)


class TorchModuleLoss(Loss):
    """A torch loss module, called as `module(y_pred, y_true)`."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(snake_case(type(module).__name__))
        self.module = module

    def __call__(
        self, y_true: torch.Tensor, y_pred: torch.Tensor, sample_weight: torch.Tensor | float | None = None
    ) -> torch.Tensor:
        if not isinstance(y_pred, torch.Tensor):
            y_pred = as_scores(y_pred)
        y_true = torch.as_tensor(y_true, device=y_pred.device)
        if sample_weight is None:
            value = self.module(y_pred, y_true)
            return value if value.ndim == 0 else value.mean()
        if not hasattr(self.module, "reduction"):
            raise TypeError(
                f"Invalid `sample_weight`: {type(self.module).__name__} has no `reduction` to turn off, "
                f"so it cannot weight samples; received sample_weight of type {type(sample_weight).__name__}."
            )
        # torch types a Module's attributes as Tensor | Module; a loss's ``reduction`` is a str.
        saved, self.module.reduction = self.module.reduction, "none"  # type: ignore[assignment]
        try:
            values = self.module(y_pred, y_true)
        finally:
            self.module.reduction = saved
        # Each value weighted by its sample's weight, then reduced as the module reduces: a sum stays a sum,
        # and a mean divides by the module's own count, so that weights of one give the unweighted loss
        weighted = reduce_weighted(values, sample_weight, "sum")
        if saved == "sum":
            return weighted
        if saved == "batchmean":  # KLDivLoss: the sum over the batch size
            return weighted / max(values.shape[0] if values.ndim else 1, 1)
        return weighted / self._count(values, y_true)

    def _count(self, values: torch.Tensor, y_true: torch.Tensor) -> torch.Tensor | int:
        """What the module's ``reduction="mean"`` divides by: for class-index targets of a cross-entropy or
        NLL loss, the targets other than ``ignore_index`` (each counted by its class ``weight`` where one is
        given; 1 where none is left: the loss is then 0, as Keras's ``divide_no_nan``); else every value."""
        module = self.module
        if not isinstance(module, (nn.CrossEntropyLoss, nn.NLLLoss)) or torch.is_floating_point(y_true):
            return values.numel()
        counted = y_true != module.ignore_index
        if module.weight is None:
            count = counted.sum().to(values.dtype)
        else:
            count = (module.weight.to(values.dtype)[torch.where(counted, y_true, 0)] * counted).sum()
        return torch.where(count == 0, torch.ones_like(count), count)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.module!r})"


class _FunctionLoss(Loss):
    """A plain callable `fn(y_true, y_pred)`: its per-sample values are reduced like any Loss."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        name = getattr(fn, "__name__", "")
        super().__init__(name if name.isidentifier() else "loss")
        self.fn = fn

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        # As Keras's LossFunctionWrapper: targets and outputs brought to one rank first, so that (n,)
        # targets meet (n, 1) outputs row by row, not broadcast to (n, n)
        if isinstance(y_true, torch.Tensor) and isinstance(y_pred, torch.Tensor):
            y_true, y_pred = to_same_rank(y_true, y_pred)
        return torch.as_tensor(self.fn(y_true, y_pred))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fn!r})"


_CLASSES: dict[str, type[Loss]] = {
    cls.__name__: cls
    for cls in (
        SparseCategoricalCrossentropy,
        CategoricalCrossentropy,
        BinaryCrossentropy,
        MeanSquaredError,
        MeanAbsoluteError,
        Huber,
    )
}
_ALIASES: dict[str, type[Loss]] = {
    "mse": MeanSquaredError,
    "mae": MeanAbsoluteError,
    "huber": Huber,
    "huber_loss": Huber,
    **{snake_case(name): cls for name, cls in _CLASSES.items()},
    **_CLASSES,
}


def _key(name: str) -> str:
    return name.replace("_", "").lower()


_LOOKUP: dict[str, type[Loss]] = {_key(name): cls for name, cls in _ALIASES.items()}


def get(identifier: str | Loss | nn.Module | Callable[..., Any] | dict[str, Any]) -> Loss:
    """Resolve a loss identifier to a `Loss`.

    Args:
        identifier: A name (`"sparse_categorical_crossentropy"`, `"mse"`, `"mae"`, `"huber"`,
            `"binary_crossentropy"`, `"categorical_crossentropy"`, or a class name; case and
            underscores are ignored), a `Loss` (returned as is), a torch loss module (called as
            `module(y_pred, y_true)`), a callable `fn(y_true, y_pred)` (its values averaged), or a
            dict from `serialize`.

    Returns:
        The `Loss`.

    Raises:
        ValueError: If a name is unknown.
        TypeError: If the identifier has an unsupported type.

    Example:
        >>> import meshfit.losses as losses
        >>> losses.get("mse").name
        'mean_squared_error'
    """
    if isinstance(identifier, Loss):
        return identifier
    if isinstance(identifier, str):
        cls = _LOOKUP.get(_key(identifier))
        if cls is None:
            raise ValueError(
                f"Invalid `loss`: expected one of {sorted(_ALIASES)}, received loss={identifier!r}."
            )
        return cls()
    if isinstance(identifier, dict):
        return deserialize(identifier)
    if isinstance(identifier, nn.Module):
        return TorchModuleLoss(identifier)
    if callable(identifier):
        return _FunctionLoss(identifier)
    raise TypeError(
        "Invalid `loss`: expected a name, a meshfit Loss, a torch loss module or a callable, "
        f"received loss={identifier!r} of type {type(identifier).__name__}."
    )


def serialize(loss: str | Loss | nn.Module | Callable[..., Any]) -> dict[str, Any] | None:
    """Describe a built-in loss as `{"class_name": ..., "config": ...}`, JSON-serialisable.

    Args:
        loss: Anything `get` accepts.

    Returns:
        The dict, or `None` when the loss cannot be rebuilt from a description (torch loss modules,
        callables, user-defined `Loss` subclasses).
    """
    return describe(get(loss), _CLASSES)


def deserialize(config: dict[str, Any], custom_objects: dict[str, type[Loss]] | None = None) -> Loss:
    """Rebuild a loss from `serialize`'s output.

    Args:
        config: `{"class_name": name, "config": dict}`.
        custom_objects: Extra `Loss` classes by class name.

    Returns:
        The loss.

    Raises:
        ValueError: If the class name is unknown or the dict is malformed.
    """
    return rebuild(config, _CLASSES, custom_objects)
