"""The accuracy metrics: the mean over samples of a per-sample hit (1.0) or miss (0.0), as Keras's."""

from __future__ import annotations

from typing import Any

import torch

from meshfit.losses import squeeze_or_expand
from meshfit.metrics._mean import MeanMetricWrapper


def _sparse_labels(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    """Integer labels with one dim fewer than the class scores."""
    labels = y_true.squeeze(-1) if y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1 else y_true
    return labels if labels.dtype is torch.int64 else labels.long()


# The hits (True / False per sample): the accuracy metrics count them (`Mean` sums booleans in float64,
# exactly, without a float64 copy); the public functions below return them as Keras's 1.0 / 0.0.
def _sparse_categorical_hits(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    if y_true.dtype is torch.int64 and y_true.ndim != y_pred.ndim:  # labels as they are: no call a step
        return y_pred.argmax(dim=-1) == y_true
    return y_pred.argmax(dim=-1) == _sparse_labels(y_true, y_pred)


def _categorical_hits(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    return y_pred.argmax(dim=-1) == y_true.argmax(dim=-1)


def _binary_hits(y_true: torch.Tensor, y_pred: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    y_true, y_pred = squeeze_or_expand(y_true, y_pred)
    return (y_pred > threshold) == (y_true > 0.5)


def _exact_hits(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    y_true, y_pred = squeeze_or_expand(y_true, y_pred)
    return y_pred == y_true.to(y_pred.dtype)


def _sparse_top_k_hits(y_true: torch.Tensor, y_pred: torch.Tensor, k: int = 5) -> torch.Tensor:
    # Keras's in_top_k: a hit where the label's score reaches the k-th largest (a tie at it counts)
    kth = y_pred.topk(min(k, y_pred.shape[-1]), dim=-1).values[..., -1:]
    labelled = y_pred.gather(-1, _sparse_labels(y_true, y_pred).unsqueeze(-1))
    return (labelled >= kth).squeeze(-1)


def sparse_categorical_accuracy(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    """1.0 where the integer label equals the arg-max of the last dim of `y_pred`, else 0.0."""
    return _sparse_categorical_hits(y_true, y_pred).to(torch.float64)


def categorical_accuracy(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    """1.0 where the arg-maxes of one-hot `y_true` and `y_pred` agree, else 0.0."""
    return _categorical_hits(y_true, y_pred).to(torch.float64)


def binary_accuracy(y_true: torch.Tensor, y_pred: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """1.0 where `y_pred > threshold` equals the 0/1 label, per element."""
    return _binary_hits(y_true, y_pred, threshold).to(torch.float64)


def accuracy(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    """1.0 where `y_pred` equals `y_true` exactly, per element."""
    return _exact_hits(y_true, y_pred).to(torch.float64)


def sparse_top_k_categorical_accuracy(y_true: torch.Tensor, y_pred: torch.Tensor, k: int = 5) -> torch.Tensor:
    """1.0 where the integer label is among the `k` highest scores of the last dim, else 0.0."""
    return _sparse_top_k_hits(y_true, y_pred, k).to(torch.float64)


class SparseCategoricalAccuracy(MeanMetricWrapper):
    """How often the arg-max of `y_pred` equals the integer label `y_true`.

    Example:
        >>> import torch, meshfit.metrics as metrics
        >>> m = metrics.SparseCategoricalAccuracy()
        >>> m.update_state(torch.tensor([0, 1]), torch.tensor([[0.9, 0.1], [0.8, 0.2]]))
        >>> float(m.result())
        0.5
    """

    def __init__(self, name: str = "sparse_categorical_accuracy", mesh: Any = None) -> None:
        super().__init__(_sparse_categorical_hits, name, mesh)

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:  # type: ignore[override]
        """Count one batch's hits. The usual step (int64 labels, one dim fewer than the detached scores,
        no weights, all on the states' device) compares them and keeps the hits, summed with the next
        batches' when the states are read: the same float64 sum, two kernels a step instead of four."""
        if (sample_weight is None and y_pred.__class__ is torch.Tensor and y_true.__class__ is torch.Tensor
                and y_true.dtype is torch.int64 and not y_pred.requires_grad and y_true.ndim == 1 and y_pred.ndim == 2):
            if self._states["total"].device == y_pred.device and y_true.device == y_pred.device:
                self._count_hits(y_pred.argmax(dim=-1) == y_true)  # summed with the next ones when read
                return
        super().update_state(y_true, y_pred, sample_weight)


class CategoricalAccuracy(MeanMetricWrapper):
    """How often the arg-max of `y_pred` equals the arg-max of one-hot `y_true`."""

    def __init__(self, name: str = "categorical_accuracy", mesh: Any = None) -> None:
        super().__init__(_categorical_hits, name, mesh)


class BinaryAccuracy(MeanMetricWrapper):
    """How often `y_pred > threshold` matches the 0/1 label.

    Args:
        name: The metric's name.
        threshold: Decision threshold (`0.0` suits logits).
    """

    def __init__(self, name: str = "binary_accuracy", threshold: float = 0.5) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise TypeError(f"Invalid `threshold`: expected a float, received threshold={threshold!r}.")
        super().__init__(_binary_hits, name, threshold=float(threshold))


class Accuracy(MeanMetricWrapper):
    """How often `y_pred` equals `y_true` exactly."""

    def __init__(self, name: str = "accuracy") -> None:
        super().__init__(_exact_hits, name)


class SparseTopKCategoricalAccuracy(MeanMetricWrapper):
    """How often the integer label is among the `k` highest scores.

    Args:
        k: Positive int.
        name: The metric's name.
    """

    def __init__(self, k: int = 5, name: str = "sparse_top_k_categorical_accuracy") -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"Invalid `k`: expected a positive int, received k={k!r}.")
        super().__init__(_sparse_top_k_hits, name, k=k)


class _CrossEntropyAccuracy(SparseCategoricalAccuracy):
    """`"accuracy"` with torch's cross-entropy, which takes class indices or class probabilities: sparse
    categorical accuracy for indices, categorical accuracy for probability (one-hot) targets of the
    scores' shape (Keras 3 picks by shape too)."""

    def __init__(self, name: str = "accuracy", mesh: Any = None) -> None:
        super().__init__(name, mesh)
        # int64 class indices of (batch,) take the sparse fast path; any other input reaches this function
        # after MeanMetricWrapper's conversions (numpy, DTensor, device)
        self._fn = _cross_entropy_hits


def _cross_entropy_hits(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    """Categorical hits for probability targets of the scores' shape, sparse hits for class indices."""
    if y_true.dtype.is_floating_point and y_true.ndim > 1 and tuple(y_true.shape) == tuple(y_pred.shape):
        return _categorical_hits(y_true, y_pred)
    return _sparse_categorical_hits(y_true, y_pred)


class _AutoAccuracy(MeanMetricWrapper):
    """`"accuracy"` with an unknown loss: picks binary / sparse / categorical from shapes, as Keras 3."""

    def __init__(self, name: str) -> None:
        super().__init__(self._pick, name)

    @staticmethod
    def _pick(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        if y_pred.ndim <= 1 or y_pred.shape[-1] == 1:
            return _binary_hits(y_true, y_pred)
        if y_true.ndim < y_pred.ndim or y_true.shape[-1] == 1:
            return _sparse_categorical_hits(y_true, y_pred)
        return _categorical_hits(y_true, y_pred)
