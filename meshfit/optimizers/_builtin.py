"""The built-in optimizers with Keras's names and defaults, each building its `torch.optim` class."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from meshfit.optimizers._arguments import (
    NON_NEGATIVE,
    POSITIVE,
    UNIT,
    check_bool,
    check_mesh,
    check_number,
    check_weight_decay,
)
from meshfit.optimizers._optimizers import Optimizer


class SGD(Optimizer):
    """Stochastic gradient descent; builds `torch.optim.SGD`.

    Args:
        learning_rate: Positive step size.
        momentum: Momentum in `[0, 1)`.
        nesterov: Whether to use Nesterov momentum (needs `momentum > 0`).
        weight_decay: L2 penalty, or `None`.
        mesh: a `meshfit.dtensor.Mesh`, as DTensor Keras optimizers take (the state of a DTensor
            parameter has its layout either way).
        **kwargs: Keras's arguments common to every optimizer: `clipnorm`, `clipvalue`,
            `global_clipnorm`, `use_ema`, `ema_momentum`, `ema_overwrite_frequency` (see `Optimizer`).
    """

    torch_class = torch.optim.SGD
    config_keys = ("momentum", "nesterov", "weight_decay")

    def __init__(
        self,
        learning_rate: float = 0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float | None = None,
        *,
        mesh: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate, **kwargs)
        self.mesh = check_mesh(mesh)
        self.momentum = check_number("momentum", momentum, UNIT)
        self.nesterov = check_bool("nesterov", nesterov)
        if nesterov and momentum == 0:
            raise ValueError(f"Invalid `nesterov`: needs momentum > 0, received momentum={momentum!r}.")
        self.weight_decay = check_weight_decay(weight_decay)


class Adam(Optimizer):
    """Adam; builds `torch.optim.Adam` with Keras's defaults.

    Args:
        learning_rate: Positive step size.
        beta_1: Decay of the first-moment estimate, in `[0, 1)`.
        beta_2: Decay of the second-moment estimate, in `[0, 1)`.
        epsilon: Positive constant for numerical stability.
        amsgrad: Whether to use the AMSGrad variant.
        weight_decay: L2 penalty, or `None`.
        mesh: a `meshfit.dtensor.Mesh`, as DTensor Keras optimizers take (the state of a DTensor
            parameter has its layout either way).
        **kwargs: Keras's arguments common to every optimizer: `clipnorm`, `clipvalue`,
            `global_clipnorm`, `use_ema`, `ema_momentum`, `ema_overwrite_frequency` (see `Optimizer`).
    """

    torch_class: type[torch.optim.Optimizer] = torch.optim.Adam
    config_keys = ("beta_1", "beta_2", "epsilon", "amsgrad", "weight_decay")
    fuses = True

    def __init__(
        self,
        learning_rate: float = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        weight_decay: float | None = None,
        *,
        mesh: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate, **kwargs)
        self.mesh = check_mesh(mesh)
        self.beta_1 = check_number("beta_1", beta_1, UNIT)
        self.beta_2 = check_number("beta_2", beta_2, UNIT)
        self.epsilon = check_number("epsilon", epsilon, POSITIVE)
        self.amsgrad = check_bool("amsgrad", amsgrad)
        self.weight_decay = check_weight_decay(weight_decay)

    def _torch_kwargs(self) -> dict[str, Any]:
        kwargs = super()._torch_kwargs()
        kwargs["betas"] = (kwargs.pop("beta_1"), kwargs.pop("beta_2"))
        return kwargs


class AdamW(Adam):
    """Adam with decoupled weight decay; builds `torch.optim.AdamW` with Keras's defaults.

    Args:
        learning_rate: Positive step size.
        weight_decay: Decoupled weight decay (non-negative).
        beta_1: Decay of the first-moment estimate, in `[0, 1)`.
        beta_2: Decay of the second-moment estimate, in `[0, 1)`.
        epsilon: Positive constant for numerical stability.
        amsgrad: Whether to use the AMSGrad variant.
        **kwargs: Keras's arguments common to every optimizer: `clipnorm`, `clipvalue`,
            `global_clipnorm`, `use_ema`, `ema_momentum`, `ema_overwrite_frequency` (see `Optimizer`).
    """

    torch_class = torch.optim.AdamW

    def __init__(
        self,
        learning_rate: float = 0.001,
        weight_decay: float = 0.004,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        **kwargs: Any,
    ) -> None:
        check_number("weight_decay", weight_decay, NON_NEGATIVE)
        super().__init__(learning_rate, beta_1, beta_2, epsilon, amsgrad, weight_decay, **kwargs)


class RMSprop(Optimizer):
    """RMSprop; builds `torch.optim.RMSprop` (`rho` is torch's `alpha`).

    Args:
        learning_rate: Positive step size.
        rho: Decay of the squared-gradient average, in `[0, 1)`.
        momentum: Momentum in `[0, 1)`.
        epsilon: Positive constant for numerical stability.
        centered: Whether to normalise by the gradient's estimated variance.
        weight_decay: L2 penalty, or `None`.
        **kwargs: Keras's arguments common to every optimizer: `clipnorm`, `clipvalue`,
            `global_clipnorm`, `use_ema`, `ema_momentum`, `ema_overwrite_frequency` (see `Optimizer`).
    """

    torch_class = torch.optim.RMSprop
    config_keys = ("rho", "momentum", "epsilon", "centered", "weight_decay")

    def __init__(
        self,
        learning_rate: float = 0.001,
        rho: float = 0.9,
        momentum: float = 0.0,
        epsilon: float = 1e-7,
        centered: bool = False,
        weight_decay: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate, **kwargs)
        self.rho = check_number("rho", rho, UNIT)
        self.momentum = check_number("momentum", momentum, UNIT)
        self.epsilon = check_number("epsilon", epsilon, POSITIVE)
        self.centered = check_bool("centered", centered)
        self.weight_decay = check_weight_decay(weight_decay)


class Adagrad(Optimizer):
    """Adagrad; builds `torch.optim.Adagrad` with Keras's defaults.

    Args:
        learning_rate: Positive step size.
        initial_accumulator_value: Non-negative starting value of the accumulators.
        epsilon: Positive constant for numerical stability.
        weight_decay: L2 penalty, or `None`.
        **kwargs: Keras's arguments common to every optimizer: `clipnorm`, `clipvalue`,
            `global_clipnorm`, `use_ema`, `ema_momentum`, `ema_overwrite_frequency` (see `Optimizer`).
    """

    torch_class = torch.optim.Adagrad
    config_keys = ("initial_accumulator_value", "epsilon", "weight_decay")

    def __init__(
        self,
        learning_rate: float = 0.001,
        initial_accumulator_value: float = 0.1,
        epsilon: float = 1e-7,
        weight_decay: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(learning_rate, **kwargs)
        self.initial_accumulator_value = check_number(
            "initial_accumulator_value", initial_accumulator_value, NON_NEGATIVE
        )
        self.epsilon = check_number("epsilon", epsilon, POSITIVE)
        self.weight_decay = check_weight_decay(weight_decay)


class TorchOptimizer(Optimizer):
    """Wraps a `torch.optim.Optimizer`: a built one (`built` is True; `build` is a no-op), or a torch
    optimizer *class*, built on the model's parameters with the class's default learning rate.

    Its parameter groups keep their rates' ratios to the first group's when a callback or a schedule
    sets `learning_rate`.

    Args:
        optimizer: The torch optimizer, or its class (``torch.optim.Adam``).
        **kwargs: `clipnorm`, `clipvalue`, `global_clipnorm`, `use_ema`, ... as for every `Optimizer`.

    Raises:
        TypeError: If `optimizer` is neither a `torch.optim.Optimizer` nor a subclass of it.
        ValueError: If a class has no default learning rate.
    """

    def __init__(self, optimizer: torch.optim.Optimizer | type[torch.optim.Optimizer], **kwargs: Any) -> None:
        if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
            super().__init__(_default_rate(optimizer), **kwargs)
            self.torch_class = optimizer
            return
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "Invalid `optimizer`: expected a torch.optim.Optimizer or a subclass of it, received "
                f"optimizer={optimizer!r}."
            )
        super().__init__(float(optimizer.param_groups[0]["lr"]), **kwargs)
        self._torch_optimizer = optimizer
        self.torch_class = type(optimizer)
        self._on_built()

    def build(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]]) -> None:
        """Build a class given at construction on `params`; no-op for a built torch optimizer."""
        if self._torch_optimizer is None:
            super().build(params)

    def __repr__(self) -> str:
        return f"TorchOptimizer({self.torch_class.__name__})"


def _default_rate(torch_class: type[torch.optim.Optimizer]) -> float:
    lr = inspect.signature(torch_class.__init__).parameters.get("lr")
    default = None if lr is None else lr.default
    if isinstance(default, bool) or not isinstance(default, (int, float)) or default <= 0:
        raise ValueError(f"Invalid `optimizer`: the class {torch_class.__name__} has no default learning rate to "
                         f"build it with; pass {torch_class.__name__}(model.parameters(), lr=...) or a meshfit "
                         "optimizer such as mf.optimizers.Adam(learning_rate=...).")
    return float(default)


_CLASSES: dict[str, type[Optimizer]] = {cls.__name__: cls for cls in (SGD, Adam, AdamW, RMSprop, Adagrad)}
# By name, for get("adam"): each built-in class has a default learning rate.
_LOOKUP: dict[str, Callable[[], Optimizer]] = {cls.__name__.lower(): cls for cls in (SGD, Adam, AdamW, RMSprop, Adagrad)}
