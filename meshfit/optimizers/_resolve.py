"""Resolving optimizer identifiers (names, meshfit optimizers, built torch optimizers) and their configs."""

from __future__ import annotations

from typing import Any

import torch

from meshfit._serialization import describe, rebuild
from meshfit.optimizers._builtin import _CLASSES, _LOOKUP, TorchOptimizer
from meshfit.optimizers._optimizers import Optimizer


def get(identifier: str | Optimizer | torch.optim.Optimizer | dict[str, Any]) -> Optimizer:
    """Resolve an optimizer identifier to an `Optimizer`.

    Args:
        identifier: `"sgd"`, `"adam"`, `"adamw"`, `"rmsprop"` or `"adagrad"` (any case), an
            `Optimizer` (returned as is), a built `torch.optim.Optimizer` or a torch optimizer class
            such as ``torch.optim.Adam`` (wrapped in `TorchOptimizer`), or a dict from `serialize`.

    Returns:
        The optimizer, unbuilt unless it wraps a torch optimizer.

    Raises:
        ValueError: If a name is unknown.
        TypeError: If the identifier has an unsupported type.

    Example:
        >>> import meshfit.optimizers as optimizers
        >>> optimizers.get("adam").learning_rate
        0.001
    """
    if isinstance(identifier, Optimizer):
        return identifier
    if isinstance(identifier, torch.optim.Optimizer) or (
            isinstance(identifier, type) and issubclass(identifier, torch.optim.Optimizer)):
        return TorchOptimizer(identifier)  # a class is built on the model's parameters
    if isinstance(identifier, str):
        cls = _LOOKUP.get(identifier.lower())
        if cls is None:
            raise ValueError(
                f"Invalid `optimizer`: expected one of {sorted(_LOOKUP)}, received optimizer={identifier!r}."
            )
        return cls()
    if isinstance(identifier, dict):
        return deserialize(identifier)
    raise TypeError(
        "Invalid `optimizer`: expected a name, a meshfit Optimizer, a torch.optim.Optimizer or its class, "
        f"received optimizer={identifier!r} of type {type(identifier).__name__}."
    )


def serialize(optimizer: str | Optimizer | torch.optim.Optimizer) -> dict[str, Any] | None:
    """Describe a built-in optimizer as `{"class_name": ..., "config": ...}`, JSON-serialisable.

    Args:
        optimizer: Anything `get` accepts.

    Returns:
        The dict, or `None` for wrapped torch optimizers and user-defined subclasses.
    """
    return describe(get(optimizer), _CLASSES)


def deserialize(
    config: dict[str, Any], custom_objects: dict[str, type[Optimizer]] | None = None
) -> Optimizer:
    """Rebuild an (unbuilt) optimizer from `serialize`'s output.

    Args:
        config: `{"class_name": name, "config": dict}`.
        custom_objects: Extra `Optimizer` classes by class name.

    Returns:
        The optimizer.

    Raises:
        ValueError: If the class name is unknown or the dict is malformed.
    """
    return rebuild(config, _CLASSES, custom_objects)
