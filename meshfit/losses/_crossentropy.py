"""The cross-entropy losses (sparse, categorical, binary), Keras's on torch's kernels."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F

from meshfit._lazy_dtensor import is_dtensor
from meshfit._validation import check_bool, invalid_argument
from meshfit.losses._losses import (
    NARROW_FLOATS,
    Loss,
    as_scores,
    mean_last_dim,
    reduce_weighted,
    squeeze_or_expand,
)

EPSILON = 1e-7
# torch's cross-entropy skips targets equal to its ``ignore_index`` (-100 by default, leaving a silent zero);
# Keras has no such class: every label counts, and one out of range is an error. No label is this one: odd
# and beyond 2**53, no float label cast to int64 gives it (a NaN or an overflow gives -2**63 or 2**63 - 1,
# both out of range), nor does any int32 label.
_NO_IGNORED_CLASS = -(2**62) - 1

def _warn_if_logits(loss: SparseCategoricalCrossentropy | CategoricalCrossentropy | BinaryCrossentropy,
                    y_pred: torch.Tensor) -> None:
    """Warn once per loss when ``from_logits=False`` meets outputs outside ``[0, 1]``: logits, almost surely
    (Keras warns for the opposite mistake). Looked at on the first batch only: one host sync per loss."""
    if loss.from_logits or loss._outputs_checked:
        return
    loss._outputs_checked = True
    local = (y_pred.to_local() if hasattr(y_pred, "to_local") else y_pred).detach()  # no collective for a DTensor
    with torch.no_grad():
        outside = local.numel() > 0 and bool(((local < 0) | (local > 1)).any())
    if outside:
        warnings.warn(
            f"`{loss.name}` received from_logits=False (Keras's default), but the predictions are not "
            f"probabilities: they hold values outside [0, 1] (min {float(local.min()):.3g}, max "
            f"{float(local.max()):.3g}), as logits do, and training on them learns little. If the module "
            f"outputs logits, use meshfit.losses.{type(loss).__name__}(from_logits=True); else end it "
            "with a softmax (sigmoid for binary).",
            stacklevel=4,
        )

def _check_smoothing(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(
            f"Invalid `label_smoothing`: expected a float in [0, 1], received label_smoothing={value!r}."
        )
    return float(value)

class SparseCategoricalCrossentropy(Loss):
    """Cross-entropy between integer labels and class scores (classes on dim `axis`).

    Every label counts: one outside ``[0, classes)`` is an error (torch's ``ignore_index`` skips none). A
    label to leave out (a padding or "void" class, torch's -100) is Keras's ``ignore_class``.

    Args:
        from_logits: Whether `y_pred` holds logits (else probabilities, clamped to `[1e-7, 1 - 1e-7]`).
        axis: The class dim of `y_pred`; `-1` as in Keras, `1` for torch's `(n, classes, ...)`.
        name: Name of the loss.
        reduction: See `Loss`.
        ignore_class: A label whose samples count for nothing (Keras 3's argument): their loss is 0, and
            ``"sum_over_batch_size"`` divides by the number of the other labels.

    Example:
        >>> import torch
        >>> loss = SparseCategoricalCrossentropy(from_logits=True, ignore_class=-100)
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [5.0, -5.0]])
        >>> round(float(loss(torch.tensor([0, 1, -100]), logits)), 4)  # the mean over the two labels
        0.1269
    """

    config_keys = ("from_logits", "axis", "ignore_class")

    def __init__(
        self,
        from_logits: bool = False,
        axis: int = -1,
        name: str | None = None,
        reduction: str = "sum_over_batch_size",
        ignore_class: int | None = None,
    ) -> None:
        super().__init__(name, reduction)
        check_bool("from_logits", from_logits)
        if ignore_class is not None and (isinstance(ignore_class, bool) or not isinstance(ignore_class, int)):
            raise invalid_argument("ignore_class", "an int label (or None)", ignore_class, TypeError)
        self.from_logits = from_logits
        self._outputs_checked = False
        self.axis = axis
        self.ignore_class = ignore_class

    def _target(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        """The labels as int64, one dim fewer than the scores (a size-1 dim at ``axis`` squeezed, as Keras)."""
        if y_true.ndim == y_pred.ndim and y_true.ndim and y_true.shape[self.axis] == 1:
            y_true = y_true.squeeze(self.axis)
        return y_true if y_true.dtype is torch.int64 else y_true.long()

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        """Per-sample cross-entropy (0 for an ``ignore_class`` label: torch's kernel skips it, forward and
        backward, as its ``ignore_index``)."""
        target = self._target(y_true, y_pred)
        if not (self.from_logits or self._outputs_checked):
            _warn_if_logits(self, y_pred)
        return self._per_label(target, y_pred)

    def _per_label(self, target: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        """`call` on int64 labels: the scores' classes moved where torch's kernel takes them."""
        if y_pred.ndim > 2 and self.axis in (-1, y_pred.ndim - 1) and target.shape == y_pred.shape[:-1] \
                and not is_dtensor(y_pred):
            # (..., classes), e.g. a language model's (batch, seq, vocab): one row per position, classes
            # contiguous. Moved to dim 1 they would be strided: (8, 64, 1024) logits took 6.3 ms forward
            # and backward that way, 2.2 ms as (512, 1024) rows. (A DTensor keeps its layout: moved.)
            rows = self._per_sample(target.reshape(-1), y_pred.reshape(-1, y_pred.shape[-1]))
            return rows.reshape(target.shape)
        # Classes on dim 1, as torch's cross_entropy takes them (no permute kernel, forward and
        # backward, where they are there already: a (batch, classes) output with axis -1).
        moved = y_pred.ndim > 1 and self.axis not in (1, 1 - y_pred.ndim)
        return self._per_sample(target, torch.movedim(y_pred, self.axis, 1) if moved else y_pred)

    def _per_sample(self, target: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The cross-entropy of each sample, classes on dim 1 of ``scores``."""
        ignored = _NO_IGNORED_CLASS if self.ignore_class is None else self.ignore_class
        try:
            if self.from_logits:
                return F.cross_entropy(scores, target, reduction="none", ignore_index=ignored)
            probs = scores / scores.sum(dim=1, keepdim=True)
            return F.nll_loss(torch.log(probs.clamp(EPSILON, 1.0 - EPSILON)), target, reduction="none",
                              ignore_index=ignored)
        except IndexError as error:
            if "out of bounds" not in str(error) or scores.ndim < 2:  # not a label's range: torch's as it is
                raise
            raise self._out_of_range(error, scores.shape[1]) from None

    def _out_of_range(self, error: IndexError, classes: int) -> IndexError:
        """torch's error for a label outside the classes, with what to do about it."""
        if self.ignore_class is not None:
            return IndexError(f"{error} `{self.name}` takes labels in [0, {classes}) and leaves out "
                              f"ignore_class={self.ignore_class} only.")
        return IndexError(f"{error} `{self.name}` takes labels in [0, {classes}). To leave one out (a padding or "
                          "void label, as torch's ignore_index), pass it as Keras's ignore_class: "
                          f"{type(self).__name__}(from_logits={self.from_logits}, ignore_class=-100) for -100.")

    def __call__(self, y_true: torch.Tensor, y_pred: torch.Tensor,
                 sample_weight: torch.Tensor | float | None = None) -> torch.Tensor:
        """The reduced loss of a batch. The usual case (logits of shape ``(batch, classes)``, int64 labels,
        no weights, the mean over the batch) is torch's own mean cross-entropy: one kernel forward and
        one backward where the per-sample losses, their sum and the division took three and three.
        Half-precision scores are widened to float32 first (Keras computes its losses in float32)."""
        if not isinstance(y_pred, torch.Tensor):
            y_pred = as_scores(y_pred)
        if y_pred.dtype in NARROW_FLOATS:
            y_pred = y_pred.float()
        if (sample_weight is None and y_pred.__class__ is torch.Tensor and y_true.__class__ is torch.Tensor
                and self.from_logits and self.reduction == "sum_over_batch_size" and y_pred.ndim == 2
                and y_true.ndim == 1 and y_true.dtype is torch.int64 and self.axis in (-1, 1)
                and y_true.shape[0] and self.ignore_class is None and type(self).call is SparseCategoricalCrossentropy.call
                and y_true.device == y_pred.device):
            try:
                return F.cross_entropy(y_pred, y_true, ignore_index=_NO_IGNORED_CLASS)
            except IndexError as error:
                if "out of bounds" not in str(error):
                    raise
                raise self._out_of_range(error, y_pred.shape[1]) from None
        # `Loss.__call__`'s body, not a call of it: a warning about the outputs names the caller's line
        if y_true.__class__ is not torch.Tensor or y_true.device != y_pred.device:
            y_true = torch.as_tensor(y_true, device=y_pred.device)
        if y_true.dtype in NARROW_FLOATS:
            y_true = y_true.float()
        values = self.call(y_true, y_pred)
        if self.ignore_class is None or self.reduction != "sum_over_batch_size":
            return reduce_weighted(values, sample_weight, self.reduction)
        # Keras 3: the weighted sum over the number of labels that count (0 when none does: divide_no_nan)
        total = reduce_weighted(values, sample_weight, "sum")
        counted = (self._target(y_true, y_pred) != self.ignore_class).sum().to(total.dtype)
        return total / counted.clamp(min=1)


class CategoricalCrossentropy(Loss):
    """Cross-entropy between one-hot (or soft) labels and class scores.

    Args:
        from_logits: Whether `y_pred` holds logits (else probabilities, clamped to `[1e-7, 1 - 1e-7]`).
        label_smoothing: In `[0, 1]`; labels become `y * (1 - s) + s / num_classes`.
        axis: The class dim.
        name: Name of the loss.
        reduction: See `Loss`.

    Raises:
        ValueError: If `label_smoothing` is outside `[0, 1]`.
    """

    config_keys = ("from_logits", "label_smoothing", "axis")

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        axis: int = -1,
        name: str | None = None,
        reduction: str = "sum_over_batch_size",
    ) -> None:
        super().__init__(name, reduction)
        check_bool("from_logits", from_logits)
        self.from_logits = from_logits
        self._outputs_checked = False
        self.label_smoothing = _check_smoothing(label_smoothing)
        self.axis = axis

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        """Per-sample cross-entropy."""
        if y_true.shape != y_pred.shape:
            raise ValueError(
                f"Invalid targets for `{self.name}`: expected one-hot targets of the predictions' shape "
                f"{tuple(y_pred.shape)}, received targets of shape {tuple(y_true.shape)}. For integer class "
                "labels use loss='sparse_categorical_crossentropy' (meshfit.losses.SparseCategoricalCrossentropy), "
                "or one-hot encode them.")
        _warn_if_logits(self, y_pred)
        target = y_true.to(y_pred.dtype)
        if self.label_smoothing:
            classes = y_pred.shape[self.axis]
            target = target * (1.0 - self.label_smoothing) + self.label_smoothing / classes
        if self.from_logits:
            log_probs = F.log_softmax(y_pred, dim=self.axis)
        else:
            probs = y_pred / y_pred.sum(dim=self.axis, keepdim=True)
            log_probs = torch.log(probs.clamp(EPSILON, 1.0 - EPSILON))
        return -(target * log_probs).sum(dim=self.axis)


class BinaryCrossentropy(Loss):
    """Binary cross-entropy, averaged over the last dim of each sample.

    Args:
        from_logits: Whether `y_pred` holds logits (else probabilities, clamped to `[1e-7, 1 - 1e-7]`).
        label_smoothing: In `[0, 1]`; labels become `y * (1 - s) + s / 2`.
        name: Name of the loss.
        reduction: See `Loss`.
    """

    config_keys = ("from_logits", "label_smoothing")

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        name: str | None = None,
        reduction: str = "sum_over_batch_size",
    ) -> None:
        super().__init__(name, reduction)
        check_bool("from_logits", from_logits)
        self.from_logits = from_logits
        self._outputs_checked = False
        self.label_smoothing = _check_smoothing(label_smoothing)

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        """Per-sample binary cross-entropy."""
        y_true, y_pred = squeeze_or_expand(y_true, y_pred)
        _warn_if_logits(self, y_pred)
        target = y_true.to(y_pred.dtype)
        if self.label_smoothing:
            target = target * (1.0 - self.label_smoothing) + 0.5 * self.label_smoothing
        if self.from_logits:
            values = F.binary_cross_entropy_with_logits(y_pred, target, reduction="none")
        else:
            values = F.binary_cross_entropy(y_pred.clamp(EPSILON, 1.0 - EPSILON), target, reduction="none")
        return mean_last_dim(values)

