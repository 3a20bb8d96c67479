"""Small value objects of the distribute API: `InputContext`, `ValueContext`, `CommunicationOptions`,
`ReduceOp`, `PerReplica`."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from meshfit._validation import finite_float, invalid_argument, non_negative_int, one_of


class ReduceOp(enum.Enum):
    """How `Strategy.reduce` combines the replicas' values."""

    SUM = "sum"
    MEAN = "mean"


def as_reduce_op(op: ReduceOp | str) -> ReduceOp:
    """``op`` as a `ReduceOp` (``"SUM"``/``"MEAN"`` accepted, any case); anything else refused."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str) and op.upper() in ReduceOp.__members__:
        return ReduceOp[op.upper()]
    raise ValueError(f"Invalid `reduce_op`: expected ReduceOp.SUM or ReduceOp.MEAN (or 'SUM'/'MEAN'), "
                     f"received {op!r}.")


class CommunicationImplementation(enum.Enum):
    """Which collective backend carries gradients: ``RING`` is gloo, ``NCCL`` needs GPUs, ``AUTO`` picks."""

    AUTO = "auto"
    RING = "ring"
    NCCL = "nccl"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommunicationOptions:
    """Options for cross-worker communication.

    Args:
        implementation: the collective backend (see `CommunicationImplementation`).
        timeout_seconds: how long one collective may wait for the other workers before it fails.
        heartbeat_timeout_seconds: how long a worker may stay silent before the others declare it dead
            and stop with an error that names it (``None`` turns the watchdog off). A worker not yet
            heard from gets twice as long (starting workers compete for the cores); a worker whose
            process ends is named at once, whatever this value.
        bytes_per_pack: the size of the gradient packs all-reduced as one message (DDP's buckets; a
            tensor larger than a pack is its own pack). 0, the default, is DDP's 25 MiB. Smaller packs
            start all-reducing earlier in the backward pass; the sums, and so the weights, are the same.
        gradient_compression: ``None`` (exact float32 all-reduce) or ``"bfloat16"``: each replica's
            gradient is rounded to bfloat16 for the all-reduce (half the bytes on the wire) and the
            averaged result written back in the parameters' dtype. Weights then agree with one
            device only within bfloat16 rounding (about 3 significant digits per step), not bitwise.

    Example:
        >>> CommunicationOptions(implementation=CommunicationImplementation.RING)
        CommunicationOptions(implementation=RING, timeout_seconds=300.0, heartbeat_timeout_seconds=6.0)
    """

    implementation: CommunicationImplementation = CommunicationImplementation.AUTO
    timeout_seconds: float = 300.0
    heartbeat_timeout_seconds: float | None = 6.0
    bytes_per_pack: int = 0
    gradient_compression: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.implementation, CommunicationImplementation):
            raise TypeError("Invalid `implementation`: expected a meshfit.CommunicationImplementation "
                            f"(AUTO, RING, NCCL), received implementation={self.implementation!r}.")
        finite_float("timeout_seconds", self.timeout_seconds, positive=True)
        if self.heartbeat_timeout_seconds is not None:
            finite_float("heartbeat_timeout_seconds", self.heartbeat_timeout_seconds, minimum=2)
        non_negative_int("bytes_per_pack", self.bytes_per_pack)
        one_of("gradient_compression", self.gradient_compression, (None, "bfloat16"))

    def __repr__(self) -> str:
        extra = "".join(f", {name}={getattr(self, name)!r}" for name, default in
                        (("bytes_per_pack", 0), ("gradient_compression", None)) if getattr(self, name) != default)
        return (f"CommunicationOptions(implementation={self.implementation.name}, "
                f"timeout_seconds={float(self.timeout_seconds)}, "
                f"heartbeat_timeout_seconds={self.heartbeat_timeout_seconds}{extra})")


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What an input pipeline built by ``distribute_datasets_from_function`` needs to know.

    Args:
        num_input_pipelines: how many pipelines there are (one per process).
        input_pipeline_id: this pipeline's index, ``0 <= id < num_input_pipelines``.
        num_replicas_in_sync: the number of replicas training together.

    Example:
        >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=2)
        >>> ctx.get_per_replica_batch_size(128)
        64
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self) -> None:
        for name in ("num_input_pipelines", "num_replicas_in_sync"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise invalid_argument(name, "a positive int", value)
        if not 0 <= self.input_pipeline_id < self.num_input_pipelines:
            raise ValueError(f"Invalid `input_pipeline_id`: expected 0 <= id < num_input_pipelines="
                             f"{self.num_input_pipelines}, received input_pipeline_id={self.input_pipeline_id!r}.")

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The per-replica batch for ``global_batch_size``; raises if it does not divide evenly."""
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(f"The global batch size {global_batch_size} is not divisible by the "
                             f"{self.num_replicas_in_sync} replicas in sync. Use a multiple of "
                             f"{self.num_replicas_in_sync}.")
        return global_batch_size // self.num_replicas_in_sync


@dataclasses.dataclass(frozen=True)
class ValueContext:
    """What ``strategy.experimental_distribute_values_from_function``'s function is told about its replica.

    Args:
        replica_id_in_sync_group: this replica's index, ``0 <= id < num_replicas_in_sync``.
        num_replicas_in_sync: the number of replicas training together.

    Example:
        >>> ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=2).replica_id_in_sync_group
        1
    """

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self) -> None:
        value = self.num_replicas_in_sync
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise invalid_argument("num_replicas_in_sync", "a positive int", value)
        replica = self.replica_id_in_sync_group
        if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < value:
            raise ValueError(f"Invalid `replica_id_in_sync_group`: expected an int with 0 <= id < "
                             f"num_replicas_in_sync={value}, received replica_id_in_sync_group={replica!r}.")


class PerReplica:
    """The values one ``strategy.run`` produced on this process's replicas (one per process here).

    Combine them across all replicas with ``strategy.reduce(op, value, axis)``; read this process's
    values with ``strategy.experimental_local_results(value)``. As in TensorFlow, a per-replica
    value is not a tensor: reduce it (or take the local results) before computing with it.

    Args:
        values: this process's replicas' values, in replica order.

    Example:
        >>> PerReplica((1.0,)).values
        (1.0,)
    """

    __slots__ = ("values",)

    def __init__(self, values: tuple) -> None:
        if not isinstance(values, tuple) or not values:
            raise ValueError(f"Invalid `values`: expected a non-empty tuple, received values={values!r}.")
        self.values = values

    def __repr__(self) -> str:
        return "PerReplica:{" + ", ".join(f"{i}: {v!r}" for i, v in enumerate(self.values)) + "}"

    def __bool__(self) -> bool:
        raise TypeError("A PerReplica value has no truth value: combine it first with "
                        "strategy.reduce(ReduceOp.SUM, value, axis=None).")


def regroup(result: object) -> object:
    """``strategy.run``'s result with each leaf (tensor, number) wrapped in a `PerReplica`."""
    if isinstance(result, PerReplica) or result is None or isinstance(result, (str, bytes)):
        return result
    if isinstance(result, dict):
        return type(result)((k, regroup(v)) for k, v in result.items())
    if isinstance(result, tuple) and hasattr(result, "_fields"):  # namedtuple
        namedtuple_class: Any = type(result)  # its fields are its constructor's arguments
        return namedtuple_class(*(regroup(v) for v in result))
    if isinstance(result, (tuple, list)):
        return type(result)(regroup(v) for v in result)
    return PerReplica((result,))


def select_replica(value: object) -> object:
    """``value`` as this process's replica sees it: each `PerReplica` in the structure replaced by its
    value (one replica per process), as ``strategy.run`` hands its arguments to the function. A
    structure without one is returned as it is (the same object: no container is rebuilt)."""
    if not _holds_per_replica(value):
        return value
    if isinstance(value, PerReplica):
        return value.values[0]
    if isinstance(value, dict):
        return type(value)((k, select_replica(v)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        namedtuple_class: Any = type(value)
        return namedtuple_class(*(select_replica(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(select_replica(v) for v in value)
    return value


def _holds_per_replica(value: object) -> bool:
    if isinstance(value, PerReplica):
        return True
    if isinstance(value, dict):
        return any(_holds_per_replica(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return any(_holds_per_replica(v) for v in value)
    return False


def local_results(value: object) -> tuple:
    """The local values of a `PerReplica` (or of a structure of them), as a tuple by replica."""
    if isinstance(value, PerReplica):
        return value.values
    if isinstance(value, dict):
        return ({k: local_results(v)[0] for k, v in value.items()},)
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return (type(value)(local_results(v)[0] for v in value),)
    return (value,)
