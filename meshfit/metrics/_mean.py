"""`Mean`, the weighted mean (the loss tracker, the accuracies), and `MeanMetricWrapper` over a function.

A step's update adds to float64 accumulators without a host read; whole-number counts wait on the host,
and an accuracy's hits wait as booleans, until the states are read (then added in one kernel each).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from meshfit import losses
from meshfit.metrics._metrics import Metric, _as_tensor

# Below 2**29, a whole number times a float32 (or narrower) value is exact in float64.
_EXACT_FACTOR = 2**29
_NARROW_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# Batches of hits a `Mean` keeps before summing them (or fewer, once they hold this many elements).
_HITS_KEPT = 64
_HIT_ELEMENTS_KEPT = 2**20


class Mean(Metric):
    """The (weighted) mean of the values it is given.

    Args:
        name: The metric's name.

    Example:
        >>> import meshfit.metrics as metrics
        >>> m = metrics.Mean("loss")
        >>> m.update_state(2.0, sample_weight=3)
        >>> m.update_state(4.0, sample_weight=1)
        >>> float(m.result())
        2.5
    """

    def __init__(self, name: str = "mean", mesh: Any = None) -> None:
        super().__init__(name, mesh)
        self.add_state("total")
        self.add_state("count")
        # Whole-number counts added since the state was last read: a Python number, so that a step adds
        # to one accumulator (no kernel for the count); added to ``count`` whenever the states are read.
        self._pending_count = 0.0
        self._pending_hits: list[torch.Tensor] = []  # `_count_hits`: batches of hits not summed yet
        self._pending_hit_elements = 0
        # Whether ``total`` holds a whole number (then hits summed in any grouping give the same float64);
        # False from the first value that may not be (a loss, a weight), until the next reset. The same for
        # ``count`` (a fractional weight): after one, whole counts are added at once, in order.
        self._whole_total = True
        self._whole_count = True

    def update_state(self, values: Any, sample_weight: Any = None) -> None:  # type: ignore[override]
        """Add `values` (any shape) weighted by `sample_weight`: each sample's values averaged to one, then
        weighted and counted by its weight (Keras 3's `Mean`; a scalar weight counts the batch as one sample)."""
        # Called for every metric at every step: attribute reads (``__class__``, ``ndim``, ``dtype``)
        # rather than calls where they give the same answer.
        if values.__class__ is not torch.Tensor or values.requires_grad:
            values = _as_tensor(values)
        ndim = values.ndim
        if not ndim and sample_weight.__class__ is int and 0 < sample_weight < _EXACT_FACTOR \
                and values.dtype in _NARROW_FLOATS:
            # The loss tracker's step: a scalar loss times the batch size. Its float64 product is exact
            # (at most 24 + 29 significant bits), so one ``add_`` scaled by the size gives the very sum
            # that the float64 copy, the product and the add gave (three kernels).
            total = self._states["total"]
            if total.device == values.device:
                if self._pending_hits:
                    self._add_pending_hits()
                total.add_(values, alpha=sample_weight)
                self._count(sample_weight)
                self._whole_total = False
                return
        if ndim and sample_weight is None and values.dtype is torch.bool and values.is_contiguous() \
                and values.numel() == values.shape[0]:
            # Hits (the accuracies), one a sample ((n,) or a binary head's (n, 1)): their float64 sum is the
            # whole number of hits, as the sum of their float64 copies is; no copy made.
            total = self._states["total"]
            if total.device == values.device:
                total += values.sum(dtype=torch.float64)
                self._count(values.shape[0])
                return
        if values.dtype is not torch.float64:
            values = values.to(torch.float64)
        # Keras 3 (`reduce_to_samplewise_values`): one value a sample, the mean of its elements, counted once
        # (each sample weighs the same, whatever its length); a batch weighted by one number is one sample
        # of that weight, its values' mean.
        if sample_weight is None:
            if ndim > 1:
                values = values.flatten(1).mean(dim=1)
            weighted, count = (values.sum(), float(values.shape[0])) if ndim else (values, 1.0)
        elif isinstance(sample_weight, (int, float)) and not isinstance(sample_weight, bool):
            count = float(sample_weight)
            weighted = (values.mean() if ndim else values) * count
        else:
            self._add_pending_count()  # weights may be fractional: keep the count's order of additions
            values, weight = _samplewise(values, _as_tensor(sample_weight).to(values.device))
            self._accumulate("total", values.sum())
            self._accumulate("count", weight.sum())
            self._whole_count = False
            return
        if not count.is_integer():  # a fractional weight: added at once, in order, from now on
            self._add_pending_count()
            self._accumulate("total", weighted)
            self._accumulate("count", count, values.device)
            self._whole_count = False
            return
        total = self._states["total"]
        if total.device == values.device:  # the usual step: the whole count stays on the host for now
            if self._pending_hits:
                self._add_pending_hits()
            total += weighted
            self._count(count)
            self._whole_total = False
            return
        self._accumulate("total", weighted)
        self._accumulate("count", count, values.device)

    def _count_hits(self, hits: torch.Tensor) -> None:
        """Count a batch's hits: ``hits`` is a boolean tensor its caller made for this (nothing else writes
        it), on the device the states live on. While ``total`` holds a whole number, batches are kept until
        the states are next read (or `_HITS_KEPT` batches, or `_HIT_ELEMENTS_KEPT` elements, wait) and then
        summed together: a step pays for its comparison alone, and whole numbers give the same float64 sum
        in any grouping. After a fraction (a weighted batch) each batch is added at once, in order."""
        count = hits.numel()
        if not self._whole_total:
            self._states["total"] += hits.sum(dtype=torch.float64)
            self._count(count)
            return
        pending = self._pending_hits
        pending.append(hits)
        self._count(count)
        self._pending_hit_elements += count
        if len(pending) >= _HITS_KEPT or self._pending_hit_elements >= _HIT_ELEMENTS_KEPT:
            self._add_pending_hits()

    def _add_pending_hits(self) -> None:
        """Add the kept batches of hits to ``total``, in one sum."""
        pending = self._pending_hits
        if pending:
            self._pending_hits, self._pending_hit_elements = [], 0
            flat = pending[0] if len(pending) == 1 else torch.cat([h if h.ndim == 1 else h.reshape(-1) for h in pending])
            self._states["total"] += flat.sum(dtype=torch.float64)

    def _accumulate(self, name: str, value: torch.Tensor | float, device: torch.device | None = None) -> None:
        if self._pending_hits:  # kept hits first: in order, and the state may move to another device here
            self._add_pending_hits()
        if name == "total":
            self._whole_total = False
        super()._accumulate(name, value, device)

    def _assign_states(self, states: dict[str, torch.Tensor]) -> None:
        super()._assign_states(states)  # (after `_live_states`: nothing kept)
        total, count = self._states["total"], self._states["count"]
        self._whole_total = bool(torch.equal(total, total.floor()))  # a restore: one host read each
        self._whole_count = bool(torch.equal(count, count.floor()))

    def _count(self, count: float) -> None:
        """Add a whole-number count: on the host while ``count`` is whole (added at the next read, in one sum),
        else at once, in order."""
        self._pending_count += count
        if not self._whole_count:
            self._add_pending_count()

    def _add_pending_count(self) -> None:
        """Add the host-side count to the ``count`` accumulator, on the device ``total`` lives on."""
        if self._pending_count:
            pending, self._pending_count = self._pending_count, 0.0
            self._accumulate("count", pending, self._states["total"].device)

    def _live_states(self) -> dict[str, torch.Tensor]:
        self._add_pending_hits()
        self._add_pending_count()
        return self._states

    def reset_state(self) -> None:
        """Zero the accumulators."""
        self._pending_count = 0.0
        self._pending_hits, self._pending_hit_elements = [], 0
        self._whole_total = self._whole_count = True
        super().reset_state()

    def result_from(self, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """`total / count`, or 0 where the count is 0 (Keras's ``divide_no_nan``: a negative count, from
        negative weights, still divides). Chosen on the device: reading the count would wait for it."""
        total, count = states
        return torch.where(count != 0, total / count, torch.zeros_like(total))


def _samplewise(values: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keras 3's ``reduce_to_samplewise_values`` (with the mean): ``values`` reduced to the weights' rank,
    weighted, then to one value a sample; the weights to one a sample. Float64."""
    values, weight = losses.to_same_rank(values, weight.to(torch.float64))
    weight_ndim, values_ndim = weight.ndim, values.ndim
    if values_ndim > weight_ndim:
        values = values.mean(dim=tuple(range(weight_ndim, values_ndim))) if weight_ndim else values.mean()
    weight = weight.broadcast_to(values.shape)
    values = values * weight
    if weight_ndim > 1:
        weight = weight.mean(dim=tuple(range(1, weight_ndim)))
    if values.ndim > 1:
        values = values.mean(dim=tuple(range(1, values.ndim)))
    return values, weight


class MeanMetricWrapper(Mean):
    """The weighted mean over samples of `fn(y_true, y_pred, **kwargs)`.

    Args:
        fn: Returns one value per sample, or per element (each sample's elements are averaged first,
            as Keras 3 does); a scalar counts as one value.
        name: The metric's name; defaults to `fn.__name__`.
        **kwargs: Passed to `fn`.
    """

    def __init__(self, fn: Callable[..., Any], name: str | None = None, mesh: Any = None, **kwargs: Any) -> None:
        if not callable(fn):
            raise TypeError(f"Invalid `fn`: expected a callable, received fn={fn!r}.")
        fn_name = getattr(fn, "__name__", "")
        super().__init__(name or (fn_name if fn_name.isidentifier() else "metric"), mesh)
        self._fn = fn
        self._fn_kwargs = kwargs

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:  # type: ignore[override]
        """Accumulate `fn`'s values for one batch."""
        if y_pred.__class__ is not torch.Tensor or y_pred.requires_grad:
            y_pred = _as_tensor(y_pred)
        if y_true.__class__ is not torch.Tensor or y_true.requires_grad:
            y_true = _as_tensor(y_true)
        if y_true.device != y_pred.device:
            y_true = y_true.to(y_pred.device)
        # Both inputs are detached, so ``fn`` records no graph (no ``no_grad`` to enter at each step);
        # `Mean.update_state` detaches what it is given all the same.
        values = self._fn(y_true, y_pred, **self._fn_kwargs)
        super().update_state(values, sample_weight)
