"""The metric base and the means: additive float64 state, combined across replicas by one all-reduce sum."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from meshfit import losses
from meshfit._lazy_dtensor import is_dtensor
from meshfit._protocols import DistributionStrategy
from meshfit.distribute import current_scope_strategy
from meshfit.losses import snake_case


def _as_tensor(value: Any) -> torch.Tensor:
    if type(value) is torch.Tensor:  # the common case: no DTensor, and no graph to cut unless it has one
        return value.detach() if value.requires_grad else value
    if is_dtensor(value):  # a mesh's tensor: this process's rows (reduced over `batch` in result())
        from meshfit.dtensor import local_rows

        value = local_rows(value)
    return value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(value)


class Metric:
    """Base of metrics: additive state tensors, summed across replicas, and a result computed from them.

    Subclasses declare their states with `add_state(name, shape)` in `__init__` and implement
    `update_state` and `result_from`.

    A metric created inside a multi-replica ``strategy.scope()`` reports global values: its
    `result()` sums the replicas' states (a collective: call it on every replica, as in
    TensorFlow). `local_result()` is this replica's value alone.

    Args:
        name: The metric's name in logs; defaults to the snake-case class name.
        mesh: a `meshfit.dtensor.Mesh` (as DTensor Keras metrics take): DTensor inputs count by this
            process's rows, and `result()` sums the states over the mesh's ``batch`` axis.
    """

    _following: tuple[weakref.ref, bool] | None = None  # `follow_placement`'s strategy and lead

    def __init__(self, name: str | None = None, mesh: Any = None) -> None:
        if name is not None and not isinstance(name, str):
            raise TypeError(f"Invalid `name`: expected a str, received name={name!r}.")
        self.name = name or snake_case(type(self).__name__)
        self._states: dict[str, torch.Tensor] = {}
        self.mesh = _check_mesh(mesh)
        strategy = current_scope_strategy()
        self._strategy_ref = weakref.ref(strategy) if strategy is not None else None

    def add_state(self, name: str, shape: tuple[int, ...] = ()) -> None:
        """Declare a float64 accumulator that starts at zero (on the CPU until the first update)."""
        self._states[name] = torch.zeros(shape, dtype=torch.float64)

    def _accumulate(self, name: str, value: torch.Tensor | float, device: torch.device | None = None) -> None:
        """Add ``value`` to an accumulator, which moves once to ``value``'s device and stays there:
        a training step then queues its metric update without waiting for the device.

        ``value`` may be a Python number the host knows (a count): then it is added as a scalar, with
        no tensor made for it and no host-to-device copy, and ``device`` says where the state lives.
        """
        state = self._states[name]
        target = value.device if isinstance(value, torch.Tensor) else device
        if target is not None and state.device != target:
            state = self._states[name] = state.to(target, non_blocking=True)
        state += value

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Accumulate one (per-replica) batch."""
        raise NotImplementedError(f"{type(self).__name__} must implement `update_state`.")

    def _live_states(self) -> dict[str, torch.Tensor]:
        """The accumulators by name, as stored."""
        return self._states

    def _assign_states(self, states: dict[str, torch.Tensor]) -> None:
        """Overwrite the accumulators in place, on their device (float64 values, names and shapes checked)."""
        for key, current in self._states.items():
            current.copy_(states[key])

    def state_tensors(self) -> tuple[torch.Tensor, ...]:
        """Copies of the accumulators (float64, on the device they accumulate on); safe to all-reduce
        in place. Reading their values is the only host sync a metric needs (at a log point)."""
        return tuple(t.detach().to(torch.float64, copy=True) for t in self._live_states().values())

    def result_from(self, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The metric's value for the given (e.g. summed across replicas) states."""
        raise NotImplementedError(f"{type(self).__name__} must implement `result_from`.")

    def follow_placement(self, strategy: DistributionStrategy, lead: bool) -> None:
        """Under a placement where only some processes compute the outputs (a pipeline's last stage),
        `result()` sums the states of the processes that ``lead`` (one per replica), over every process
        of ``strategy``: the model's value on every process, not this process's share."""
        self._following = (weakref.ref(strategy), lead)

    def result(self) -> torch.Tensor:
        """The metric's value: over all replicas when created in a multi-replica strategy's scope
        (or over the mesh's ``batch`` axis with ``mesh``)."""
        states = self.state_tensors()
        following = self._following
        owner = following[0]() if following is not None else None
        if following is not None and owner is not None and owner.num_processes > 1:
            strategy: DistributionStrategy | None = owner
            lead: bool | None = following[1]  # the processes that compute the outputs send their states
        else:
            strategy, lead = self._reducing_strategy(), None
        if strategy is not None and states:
            flat = torch.cat([t.reshape(-1).to(strategy.device) for t in states])
            with strategy.guard():  # a dead peer is named, not a raw backend error
                if lead is None:
                    strategy.all_reduce_sum(flat)
                else:
                    strategy.all_reduce_states(flat, 0, lead=lead)
            states = tuple(part.reshape(t.shape) for part, t in
                           zip(flat.split([t.numel() for t in states]), states, strict=True))
        return self.result_from(states)

    def _reducing_strategy(self) -> DistributionStrategy | None:
        """The strategy whose replicas `result()` sums over, or None for a local metric."""
        if self.mesh is not None:
            return self.mesh.strategy
        strategy = self._strategy_ref() if self._strategy_ref is not None else None
        return strategy if strategy is not None and strategy.num_replicas_in_sync > 1 else None

    def local_result(self) -> torch.Tensor:
        """The metric's value for this replica's states alone."""
        return self.result_from(self.state_tensors())

    def reset_state(self) -> None:
        """Zero the accumulators."""
        for t in self._states.values():
            t.zero_()

    def reset_states(self) -> None:
        """Alias of `reset_state` (the TensorFlow 2.x tutorials' spelling)."""
        self.reset_state()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The accumulators by name (float64, CPU copies)."""
        return {key: t.detach().to("cpu", torch.float64, copy=True) for key, t in self._live_states().items()}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Restore the accumulators from `state_dict()`.

        Raises:
            ValueError: If names or shapes differ.
        """
        live = self._live_states()
        if set(state_dict) != set(live):
            raise ValueError(
                f"Invalid `state_dict` for metric {self.name!r}: expected keys {sorted(live)}, "
                f"received keys {sorted(state_dict)}."
            )
        values = {key: torch.as_tensor(state_dict[key]).to("cpu", torch.float64) for key in live}
        for key, value in values.items():
            if value.shape != live[key].shape:
                raise ValueError(
                    f"Invalid `state_dict` for metric {self.name!r}: expected {key!r} of shape "
                    f"{tuple(live[key].shape)}, received shape {tuple(value.shape)}."
                )
        self._assign_states(values)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _check_mesh(mesh: Any) -> Any:
    if mesh is None:
        return None
    from meshfit.dtensor import Mesh

    if not isinstance(mesh, Mesh) or mesh._strategy is None:
        raise TypeError(f"Invalid `mesh`: expected a mesh from meshfit.dtensor.create_mesh, received mesh={mesh!r}.")
    return mesh


# Below 2**29, a whole number times a float32 (or narrower) value is exact in float64.
_EXACT_FACTOR = 2**29
_NARROW_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# Batches of hits a `Mean` keeps before summing them (or fewer, once they hold this many elements).
_HITS_KEPT = 64
_HIT_ELEMENTS_KEPT = 2**20


def _whole_number(value: Any) -> bool:
    """Whether ``value`` is a Python int or a float holding one (not a bool)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


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

    def update_state(self, values: Any, sample_weight: Any = None) -> None:  # type: ignore[override]
        """Add `values` (any shape), each weighted by the broadcast `sample_weight`."""
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
                total.add_(values, alpha=sample_weight)
                self._pending_count += sample_weight
                return
        if ndim and sample_weight is None and values.dtype is torch.bool and values.is_contiguous():
            # Hits (the accuracies): their float64 sum is the whole number of hits, as the sum of
            # their float64 copies is; no copy made.
            total = self._states["total"]
            if total.device == values.device:
                total += values.sum(dtype=torch.float64)
                self._pending_count += values.numel()
                return
        if values.dtype is not torch.float64:
            values = values.to(torch.float64)
        if (sample_weight is None or sample_weight.__class__ is int or _whole_number(sample_weight)) and (
                not ndim or values.is_contiguous()):
            # No weight, or a whole number (the loss tracker's batch size): the count is known on
            # the host, ``n * w`` exactly (the sum of ``n`` copies of ``w``), so it is one scalar
            # add with no tensor of weights made; the total is the same sum of the same products.
            each = 1.0 if sample_weight is None else float(sample_weight)
            weighted = values if sample_weight is None else values * each
            if ndim:
                weighted = weighted.sum()
            total = self._states["total"]
            count = values.numel() * each if ndim else each  # whole numbers: exact in any order
            if total.device == values.device:  # the usual step: the count stays on the host for now
                total += weighted
                self._pending_count += count
                return
            self._accumulate("total", weighted)
            self._accumulate("count", count, values.device)
            return
        self._add_pending_count()  # a weighted count may be fractional: keep its order of additions
        if isinstance(sample_weight, (int, float)) and not isinstance(sample_weight, bool):
            weight = torch.full_like(values, float(sample_weight))  # no host-to-device copy of the number
        else:
            values, weight = losses.broadcast_weight(values, _as_tensor(sample_weight))
        self._accumulate("total", (values * weight).sum())
        self._accumulate("count", weight.sum())

    def _count_hits(self, hits: torch.Tensor) -> None:
        """Count a batch's hits: ``hits`` is a boolean tensor its caller made for this (nothing else writes
        it), on the device the states live on. Batches are kept until the states are next read (or
        `_HITS_KEPT` batches, or `_HIT_ELEMENTS_KEPT` elements, wait) and then summed together: a step
        pays for its comparison alone. Whole numbers: the float64 sum is the same in any grouping."""
        pending = self._pending_hits
        pending.append(hits)
        count = hits.numel()
        self._pending_count += count
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
        if self._pending_hits:  # kept hits first: the state may move to another device here
            self._add_pending_hits()
        super()._accumulate(name, value, device)

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
        super().reset_state()

    def result_from(self, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """`total / count`, or 0 when nothing was counted."""
        total, count = states
        return total / count if count > 0 else torch.zeros_like(total)


class Sum(Metric):
    """The (weighted) sum of the values it is given.

    Args:
        name: The metric's name.
    """

    def __init__(self, name: str = "sum") -> None:
        super().__init__(name)
        self.add_state("total")

    def update_state(self, values: Any, sample_weight: Any = None) -> None:  # type: ignore[override]
        """Add `values` times `sample_weight`."""
        values = _as_tensor(values).to(torch.float64)
        if sample_weight is not None:
            values, weight = losses.broadcast_weight(values, _as_tensor(sample_weight))
            values = values * weight
        self._accumulate("total", values.sum())

    def result_from(self, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The total."""
        return states[0].clone()


class MeanMetricWrapper(Mean):
    """The weighted mean over samples of `fn(y_true, y_pred, **kwargs)`.

    Args:
        fn: Returns one value per sample (or per element); a scalar counts as one value.
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
