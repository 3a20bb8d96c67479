"""Keras-style losses on torch tensors: the `Loss` base, its reductions, and the regression losses."""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F

from meshfit._validation import invalid_argument

REDUCTIONS = ("sum_over_batch_size", "sum", "none")

# Keras computes a loss in float32 (its variable dtype): half-precision outputs and targets are widened
# first, so that mixed precision does not round the targets or the loss (100.3 is 100.5 in bfloat16).
NARROW_FLOATS = (torch.float16, torch.bfloat16)


def as_scores(y_pred: Any) -> torch.Tensor:
    """Outputs given as numpy arrays or lists, as a tensor in torch's default float dtype (Keras converts
    them to its float dtype)."""
    return torch.as_tensor(y_pred, dtype=torch.get_default_dtype())


def snake_case(name: str) -> str:
    """`SparseCategoricalCrossentropy` -> `sparse_categorical_crossentropy`."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def squeeze_or_expand(y_true: torch.Tensor, y_pred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop a trailing size-1 dim so `(n, 1)` meets `(n,)` without broadcasting to `(n, n)`."""
    if y_pred.ndim == y_true.ndim + 1 and y_pred.shape[-1] == 1:
        y_pred = y_pred.squeeze(-1)
    elif y_true.ndim == y_pred.ndim + 1 and y_true.shape[-1] == 1:
        y_true = y_true.squeeze(-1)
    return y_true, y_pred


def to_same_rank(y_true: torch.Tensor, y_pred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keras's ``squeeze_or_expand_to_same_rank`` for two tensors whose ranks differ by one with a size-1 last
    dim (a loss function's arguments, a metric's values and weights): a rank-1 side gains a trailing dim
    ((n,) and (n, 1) meet as (n, 1)); else the larger loses its last dim."""
    true_rank, pred_rank = y_true.ndim, y_pred.ndim
    if pred_rank == true_rank + 1 and y_pred.shape[-1] == 1:
        return (y_true.unsqueeze(-1), y_pred) if true_rank == 1 else (y_true, y_pred.squeeze(-1))
    if true_rank == pred_rank + 1 and y_true.shape[-1] == 1:
        return (y_true, y_pred.unsqueeze(-1)) if pred_rank == 1 else (y_true.squeeze(-1), y_pred)
    return y_true, y_pred


def mean_last_dim(values: torch.Tensor) -> torch.Tensor:
    """Per-sample value: the mean over the last dim, as Keras's `axis=-1` losses do."""
    return values.mean(dim=-1) if values.ndim > 1 else values


def broadcast_weight(
    values: torch.Tensor, sample_weight: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`values` and `sample_weight` broadcast together, the weight aligned on leading (batch) dims."""
    weight = torch.as_tensor(sample_weight, dtype=values.dtype, device=values.device)
    while weight.ndim > values.ndim and weight.shape[-1] == 1:
        weight = weight.squeeze(-1)
    while weight.ndim < values.ndim:
        weight = weight.unsqueeze(-1)
    values, weight = torch.broadcast_tensors(values, weight)
    return values, weight


def reduce_weighted(
    values: torch.Tensor, sample_weight: torch.Tensor | float | None, reduction: str
) -> torch.Tensor:
    """Weight per-sample losses and reduce them the Keras way (`sum(w * l) / num_losses`)."""
    if sample_weight is not None:
        values, weight = broadcast_weight(values, sample_weight)
        values = values * weight
    if reduction == "none":
        return values
    total = values.sum()
    if reduction == "sum":
        return total
    count = values.numel()
    return total / (count if count > 1 else 1)  # max(count, 1), without the call


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise invalid_argument(name, f"one of {list(choices)}", value)


class Loss:
    """Base class of losses: `loss(y_true, y_pred, sample_weight=None)` gives a scalar tensor.

    Subclasses implement `call(y_true, y_pred)` returning one loss per sample (the base class
    applies `sample_weight` and the reduction) and list their other constructor arguments,
    stored as attributes, in `config_keys`.

    Args:
        name: Name of the loss; defaults to the snake-case class name.
        reduction: `"sum_over_batch_size"` (the mean over the batch, weighted as
            `sum(w * loss) / batch_size`), `"sum"`, or `"none"` (per-sample losses).

    Raises:
        ValueError: If `reduction` is not one of the above.

    Example:
        >>> import torch, meshfit.losses as losses
        >>> losses.MeanSquaredError()(torch.tensor([[0.0], [1.0]]), torch.tensor([[1.0], [1.0]]))
        tensor(0.5000)
    """

    config_keys: tuple[str, ...] = ()

    def __init__(self, name: str | None = None, reduction: str = "sum_over_batch_size") -> None:
        _check_choice("reduction", reduction, REDUCTIONS)
        self.name = name or snake_case(type(self).__name__)
        self.reduction = reduction

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        """Per-sample losses; override in subclasses."""
        raise NotImplementedError(f"{type(self).__name__} must implement `call(y_true, y_pred)`.")

    def __call__(
        self, y_true: torch.Tensor, y_pred: torch.Tensor, sample_weight: torch.Tensor | float | None = None
    ) -> torch.Tensor:
        """Compute the reduced loss of a batch (in float32 where the outputs are half precision, as Keras)."""
        if not isinstance(y_pred, torch.Tensor):  # numpy arrays, lists (Keras converts them too)
            y_pred = as_scores(y_pred)
        if y_pred.dtype in NARROW_FLOATS:
            y_pred = y_pred.float()
        if y_true.__class__ is not torch.Tensor or y_true.device != y_pred.device:  # else as_tensor gives it back
            y_true = torch.as_tensor(y_true, device=y_pred.device)
        if y_true.dtype in NARROW_FLOATS:
            y_true = y_true.float()
        return reduce_weighted(self.call(y_true, y_pred), sample_weight, self.reduction)

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments, JSON-serialisable."""
        extra = {key: getattr(self, key) for key in self.config_keys}
        return {"name": self.name, "reduction": self.reduction, **extra}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Loss:
        """Build a loss from `get_config()`'s output."""
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


class MeanSquaredError(Loss):
    """Mean of squared errors over the last dim of each sample."""

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        """Per-sample squared error."""
        y_true, y_pred = squeeze_or_expand(y_true, y_pred)
        return mean_last_dim(F.mse_loss(y_pred, y_true.to(y_pred.dtype), reduction="none"))


class MeanAbsoluteError(Loss):
    """Mean of absolute errors over the last dim of each sample."""

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        """Per-sample absolute error."""
        y_true, y_pred = squeeze_or_expand(y_true, y_pred)
        return mean_last_dim(F.l1_loss(y_pred, y_true.to(y_pred.dtype), reduction="none"))


class Huber(Loss):
    """Huber loss: quadratic for errors up to `delta`, linear beyond.

    Args:
        delta: Positive float where the loss turns linear.
        name: Name of the loss; defaults to `"huber_loss"` as in Keras.
        reduction: See `Loss`.
    """

    config_keys = ("delta",)

    def __init__(
        self, delta: float = 1.0, name: str | None = "huber_loss", reduction: str = "sum_over_batch_size"
    ) -> None:
        super().__init__(name, reduction)
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or delta <= 0:
            raise ValueError(f"Invalid `delta`: expected a positive float, received delta={delta!r}.")
        self.delta = float(delta)

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        """Per-sample Huber loss."""
        y_true, y_pred = squeeze_or_expand(y_true, y_pred)
        values = F.huber_loss(y_pred, y_true.to(y_pred.dtype), reduction="none", delta=self.delta)
        return mean_last_dim(values)
