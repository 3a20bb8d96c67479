"""The metric base and `Sum`: additive float64 state, combined across replicas by one all-reduce sum."""

from __future__ import annotations

import weakref
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
