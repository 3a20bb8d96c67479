"""TensorFlow's cross-replica surface of a strategy: ``gather``, ``extended.reduce_to`` /
``batch_reduce_to`` / ``worker_devices``, ``experimental_distribute_values_from_function``.

A mixin of `Strategy` (whose ``extended`` is the strategy itself); the collectives are
`meshfit.distribute._cross_replica`'s, over the strategy's data-parallel group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from meshfit.distribute._cross_replica import as_tensor, gather_structure, reduce_structure
from meshfit.distribute._replica_context import in_replica_context
from meshfit.distribute._values import PerReplica, ReduceOp, ValueContext, as_reduce_op, regroup


class CrossReplicaMethods:
    """`Strategy`'s methods of TensorFlow's cross-replica context (called outside ``strategy.run``)."""

    if TYPE_CHECKING:  # what the strategy provides
        @property
        def num_replicas_in_sync(self) -> int: ...

        @property
        def replica_id(self) -> int: ...

        @property
        def device(self) -> torch.device: ...

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """The devices this worker's replicas run on, as torch names them (``('cpu',)``, ``('cuda:0',)``):
        one per process, TensorFlow's ``strategy.extended.worker_devices``."""
        return (str(self.device),)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The devices this worker's copies of the variables live on (`worker_devices`)."""
        return self.worker_devices

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """Call ``value_fn(ValueContext)`` for this process's replica; a `PerReplica` value with several.

        As TensorFlow's: the result goes to ``strategy.run`` as an argument (each replica gets its own),
        or to ``strategy.reduce`` / ``gather``. One replica: ``value_fn``'s result as it is.
        """
        if not callable(value_fn):
            raise TypeError(f"Invalid `value_fn`: expected a function of a meshfit.distribute.ValueContext, "
                            f"received {value_fn!r}.")
        value = value_fn(ValueContext(replica_id_in_sync_group=self.replica_id,
                                      num_replicas_in_sync=self.num_replicas_in_sync))
        return regroup(value) if self.num_replicas_in_sync > 1 else value

    def gather(self, value: Any, axis: int) -> torch.Tensor:
        """Every replica's ``value`` concatenated along ``axis`` (replica order), on every process.

        A collective: every replica calls it. Sizes along ``axis`` may differ between replicas (e.g. a
        last, uneven batch); the other dimensions, the rank and the dtype may not ("Shape mismatch").

        Args:
            value: a `PerReplica` from ``strategy.run`` (or ``experimental_distribute_values_from_function``),
                or a tensor / NumPy array this replica holds (rank 1 or more).
            axis: the dimension to concatenate along.

        Raises:
            RuntimeError: called inside ``strategy.run``: use ``get_replica_context().all_gather`` there.
            TypeError: ``value`` is a structure, a string, None...: gather one tensor at a time.

        Example:
            >>> import torch, meshfit as mf
            >>> strategy = mf.OneDeviceStrategy("cpu")
            >>> strategy.gather(strategy.run(lambda: torch.tensor([1, 2, 3])), axis=0)
            tensor([1, 2, 3])
        """
        if in_replica_context():
            raise RuntimeError("strategy.gather needs the cross-replica context (outside strategy.run). Inside "
                               "strategy.run use meshfit.distribute.get_replica_context().all_gather(value, axis).")
        leaf = _one_value(value, "gather")
        return gather_structure(self, leaf.detach(), axis, "gather")

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any, options: Any = None) -> Any:
        """``value`` summed (``SUM``) or averaged (``MEAN``) over the replicas, placed on ``destinations``.

        TensorFlow's ``strategy.extended.reduce_to``: ``SUM`` keeps the dtype, ``MEAN`` divides (an
        integer's mean is a float tensor); every replica calls it and gets the result.

        Args:
            reduce_op: ``ReduceOp.SUM``/``MEAN`` or ``"SUM"``/``"MEAN"``.
            value: a `PerReplica`, a tensor, a NumPy array or a number.
            destinations: where the result goes: a tensor or `PerReplica` (its device), or a device
                string (``"cpu"``, ``"cuda:0"``, TensorFlow's ``"/cpu:0"``).
            options: accepted for TensorFlow's signature.

        Example:
            >>> import torch, meshfit as mf
            >>> strategy = mf.OneDeviceStrategy("cpu")
            >>> value = torch.tensor(1.0)
            >>> strategy.extended.reduce_to(mf.ReduceOp.SUM, value, value)
            tensor(1.)
        """
        return self.batch_reduce_to(reduce_op, [(value, destinations)], options)[0]

    def batch_reduce_to(self, reduce_op: ReduceOp | str, value_destination_pairs: Any,
                        options: Any = None) -> list[Any]:
        """`reduce_to` of each ``(value, destinations)`` pair, in one collective per dtype."""
        op = as_reduce_op(reduce_op)
        if in_replica_context():
            raise RuntimeError("strategy.extended.reduce_to needs the cross-replica context (outside "
                               "strategy.run). Inside strategy.run use meshfit.distribute.get_replica_context()"
                               ".all_reduce(reduce_op, value).")
        pairs = list(value_destination_pairs)
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise TypeError(f"Invalid `value_destination_pairs`: expected (value, destinations) pairs, "
                                f"received {pair!r}.")
        devices = [_destination_device(destinations) for _, destinations in pairs]
        values = [_one_value(value, "reduce_to").detach() for value, _ in pairs]
        reduced = reduce_structure(self, op, values, "reduce_to")
        return [tensor.to(device) for tensor, device in zip(reduced, devices, strict=True)]


def _one_value(value: Any, method: str) -> torch.Tensor:
    """One per-replica value or tensor as this replica's tensor; a structure or another kind is refused."""
    if isinstance(value, PerReplica):
        value = value.values[0]
    if isinstance(value, (dict, list, tuple)) or value is None or isinstance(value, (str, bytes)):
        raise TypeError(
            f"Invalid `value` for strategy.{method}: expected one per-replica value (what strategy.run "
            f"returns for a tensor), a torch.Tensor or a NumPy array, received {type(value).__name__} "
            f"{_short(value)}. Call strategy.{method} on each tensor of a structure, or combine the whole "
            f"structure inside strategy.run with meshfit.distribute.get_replica_context()."
            f"{'all_gather(value, axis)' if method == 'gather' else 'all_reduce(op, value)'}.")
    if method == "gather" and isinstance(value, (int, float, np.number)):
        raise TypeError(f"Invalid `value` for strategy.gather: expected a tensor of rank 1 or more, received the "
                        f"number {value!r}. Gather tensors (torch.tensor([value])), or combine numbers with "
                        "strategy.reduce.")
    return as_tensor(value, method)


def _destination_device(destinations: Any) -> torch.device:
    """The device ``destinations`` names: a tensor's or `PerReplica`'s, a parameter's, or a device string."""
    if isinstance(destinations, PerReplica):
        destinations = destinations.values[0]
    if isinstance(destinations, torch.Tensor):
        return destinations.device
    if isinstance(destinations, torch.device):
        return destinations
    if isinstance(destinations, str) and destinations:
        text = destinations.lower().rsplit("/device:", 1)[-1].lstrip("/").replace("gpu", "cuda")
        try:
            return torch.device(text)
        except RuntimeError:
            pass
    raise ValueError(f"Invalid `destinations`: expected a tensor or per-replica value (its device), or a device "
                     f"string such as 'cpu' or 'cuda:0', received destinations={_short(destinations)}. Pass "
                     "the value itself to reduce onto its own device.")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
