"""`Strategy`: how a training step runs. The base class is also the one-device strategy's engine.

A strategy changes only *how* a step runs: how the module is wrapped, how data is split and how
values are reduced. ``Model.fit`` is written once, against this small interface.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

from meshfit._protocols import DistributionStrategy, LayoutMapLike
from meshfit._runtime import flush_denormals
from meshfit.cluster import ClusterResolver
from meshfit.data import Dataset, map_structure
from meshfit.distribute._extended import CrossReplicaMethods
from meshfit.distribute._input._distributed_dataset import DistributedDataset, agree_on_shuffle_seeds
from meshfit.distribute._input._torch_loader import PerReplicaLoader
from meshfit.distribute._liveness._failure import FailureState
from meshfit.distribute._placement import Placement
from meshfit.distribute._plan_builder import place_replicated
from meshfit.distribute._proof._verify import StateDigest, verify_replicas
from meshfit.distribute._replica_context import replica_context_scope, use_default_strategy
from meshfit.distribute._replication import tracking_scope
from meshfit.distribute._scope import _DEFAULT, _GLOBAL_DISTRIBUTION, _SCOPE_STACK
from meshfit.distribute._values import (
    InputContext,
    PerReplica,
    ReduceOp,
    as_reduce_op,
    local_results,
    regroup,
    select_replica,
)
from meshfit.distribute._world import World

_NO_WEIGHT = contextlib.nullcontext()  # reusable: one replica weighs nothing, entered at every step


class Strategy(CrossReplicaMethods):
    """Base class of meshfit strategies: one replica in this process, no communication."""

    layout_map: LayoutMapLike | None = None  # the layouts a mesh strategy applies (none here: replicated)

    def __init__(self, device: str | torch.device | None = None) -> None:
        # one task: task_type None, as TF's single worker
        self.world = World.single(_parse_device(device))

    # ---- the world this strategy runs in (one value: see `World`) ---------------------------
    @property
    def failure(self) -> FailureState:
        """What the loop and the savers record for failure messages (the world's)."""
        return self.world.failure

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """TF's identity of this process: ``task_type``, ``task_id``, ``cluster_spec()``."""
        return self.world.cluster_resolver

    @cluster_resolver.setter
    def cluster_resolver(self, resolver: ClusterResolver) -> None:
        self.world.cluster_resolver = resolver

    @property
    def _device(self) -> torch.device:
        return self.world.device

    @_device.setter
    def _device(self, device: torch.device) -> None:
        self.world.device = device

    # ---- identity ------------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas train together."""
        return 1

    @property
    def replica_id(self) -> int:
        """This process's replica index."""
        return 0

    @property
    def num_processes(self) -> int:
        """How many processes train together (more than the replicas when a mesh has a ``model`` axis)."""
        return 1

    @property
    def is_chief(self) -> bool:
        """Whether this process writes logs, progress and files."""
        return True

    @property
    def device(self) -> torch.device:
        """The device this process's replica runs on."""
        return self._device

    @property
    def extended(self) -> Strategy:
        """TF compatibility: ``strategy.extended`` is the strategy itself."""
        return self

    def places_on_creation(self, module: torch.nn.Module) -> bool:
        """Whether ``mf.Model(module)`` places the module at once (a fully sharded mesh does; this does not)."""
        return False

    # ---- scope ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Models, optimizers and metrics created inside this context train with this strategy.

        Parameters registered by modules built inside are replicated (rank 0's initial values are
        broadcast when the scope exits) and their gradients summed by meshfit optimizers in custom
        loops; see `meshfit.distribute._replication`.
        """
        _SCOPE_STACK.append(self)
        try:
            with tracking_scope(self):
                yield self
        finally:
            _SCOPE_STACK.pop()

    # ---- running and reducing -------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        """Run ``fn`` on this process's replica, as ``tf.distribute.Strategy.run``.

        Inside, ``meshfit.distribute.get_replica_context()`` is this replica's context (its
        ``all_reduce`` / ``all_gather`` combine the replicas' values), and a `PerReplica` value among
        ``args``/``kwargs`` reaches ``fn`` as this replica's own value.

        Returns:
            ``fn``'s result; with several replicas in sync, each tensor or number in it is a
            `PerReplica` value (``strategy.reduce`` combines it, ``experimental_local_results``
            unwraps it), as in TensorFlow.
        """
        args = cast(tuple, select_replica(tuple(args)))
        kwargs = cast(dict, select_replica(dict(kwargs or {})))
        _SCOPE_STACK.append(self)  # inside run, get_strategy() is this strategy (TF's replica context)
        try:
            with self.guard(), flush_denormals(), replica_context_scope(self):  # TF flushes on its op threads
                result = fn(*args, **kwargs)
        finally:
            _SCOPE_STACK.pop()
        return regroup(result) if self.num_replicas_in_sync > 1 else result

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The values of ``value`` held by this process's replicas, as a tuple (one replica here)."""
        return local_results(value)

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> torch.Tensor:
        """Combine a per-replica value across replicas (``SUM`` or ``MEAN``); ``axis`` reduces first.

        Args:
            reduce_op: ``ReduceOp.SUM``/``MEAN`` or ``"SUM"``/``"MEAN"``.
            value: a `PerReplica` from ``run``, or a tensor/number this replica holds.
            axis: reduce this dim of each value first (``MEAN`` then divides by the global count).

        Returns:
            The combined value, the same on every replica.
        """
        op = as_reduce_op(reduce_op)
        if isinstance(value, PerReplica):
            parts = [torch.as_tensor(v).detach() for v in value.values]
            value = parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)
        tensor = torch.as_tensor(value).detach().clone()
        if axis is not None:
            count = tensor.shape[axis]
            tensor = tensor.sum(dim=axis)
        else:
            count = 1
        dtype = tensor.dtype
        with self.guard():  # a dead peer is named, as in fit, not a raw backend error
            tensor = self.all_reduce_sum(tensor.to(torch.float64))
            if op is ReduceOp.MEAN:
                total = self.all_reduce_sum(torch.tensor(float(count), dtype=torch.float64))
                tensor = tensor / total
        return tensor.to(dtype if dtype.is_floating_point else torch.float64)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over replicas, in place; returns it."""
        return tensor

    def all_reduce_states(self, tensor: torch.Tensor, flags: int = 0, lead: bool | None = None) -> torch.Tensor:
        """Sum metric states over replicas in one collective, in place; returns ``tensor``.

        Args:
            tensor: the states (values every process of a replica holds alike), then ``flags`` flags.
            flags: how many of the last entries are flags: each is summed over every process, so it
                comes back positive where any process's was.
            lead: whether this process sends its replica's states (its placement's `Residency`:
                a pipeline's last stage holds them); None: the strategy's own rule.

        Every process here is a replica of its own: the sum over replicas is the sum over processes.
        """
        if lead is False and tensor.numel() > flags:
            tensor[:tensor.numel() - flags].zero_()
        return self.all_reduce_sum(tensor)

    def all_reduce_control(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a CPU ``tensor`` of flags over every process on the control plane (gloo), in place.

        The device backend never sees it: no host-to-device-to-host copy around a flag.
        """
        return tensor

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every replica."""
        return obj

    def broadcast_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's values of ``tensor`` on every replica, in place; returns it."""
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every replica's ``obj``, by replica."""
        return [obj]

    def barrier(self) -> None:
        """Wait until every replica reaches this point."""

    # ---- placement: the one place that decides where modules and batches live ------------
    def setup_module(self, module: torch.nn.Module, jit_compile: bool = False) -> Placement:
        """Place ``module`` for training; returns its `Placement` (the module to run the training
        forward through, and the `GradientSync` an optimizer step asks).

        Every strategy asks the one plan builder (`meshfit.distribute._plan_builder`), which keeps the
        order of module transforms once: the device, layouts (a mesh strategy replaces parameters),
        then ``torch.compile`` when ``jit_compile``, then DDP (distributed strategies).
        Call it before building the optimizer: a layout replaces parameters, and an optimizer built
        earlier would hold stale ones. The module's own parameters stay the ones trained.
        """
        return place_replicated(module, self.device, jit_compile)

    def distribute_batch(self, batch: Any) -> Any:
        """This replica's batch placed for its module: tensors on the device, float64 as the default dtype.

        A CPU batch bound for a GPU is copied from page-locked (pinned) memory with
        ``non_blocking=True``, so the step queues the copy and goes on.
        """
        device = self.device
        if type(batch) is tuple:  # the usual batch: tensors already in place, as they are
            for leaf in batch:
                if type(leaf) is not torch.Tensor or leaf.dtype == torch.float64 or leaf.device != device:
                    break
            else:
                return batch

        def place(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            if leaf.dtype == torch.float64:
                leaf = leaf.to(torch.get_default_dtype())
            if leaf.device == device:
                return leaf
            if leaf.device.type == "cpu" and device.type == "cuda" and not leaf.is_pinned():
                leaf = leaf.pin_memory()  # page-locked: the copy below is asynchronous, not a host sync
            return leaf.to(device, non_blocking=True)

        return map_structure(place, batch)

    def input_context(self) -> InputContext:
        """This process's data-shard identity along the data-parallel axis.

        On a 1-D ``batch`` mesh it is the replica; on a ``batch`` × ``model`` mesh, peers along
        ``model`` read the same rows, so it comes from the ``batch`` coordinate, not the rank.
        """
        return InputContext(num_input_pipelines=self.num_replicas_in_sync, input_pipeline_id=self.replica_id,
                            num_replicas_in_sync=self.num_replicas_in_sync)

    def batch_weight(self, local_size: int, global_size: int) -> contextlib.AbstractContextManager[None]:
        """Within this context, backward weights this replica's gradient by its share of the batch.

        Replicas average their gradients, which is the gradient of the global batch's mean loss
        only when their shares are equal. For a last, uneven global batch, each replica's
        contribution is scaled by ``local_size * replicas / global_size`` — on each parameter's
        gradient before the all-reduce reads it, so it holds for a user's own ``train_step`` too. One replica: nothing to do.
        """
        return _NO_WEIGHT

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """Split a dataset batched with the global batch size into this replica's batches."""
        context = self.input_context()
        if context.num_input_pipelines > 1:
            agree_on_shuffle_seeds(dataset, self.broadcast_object)
        return DistributedDataset(dataset, context, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Any], options: Any = None) -> Any:
        """Build this replica's pipeline with ``dataset_fn(InputContext)``; it batches per replica.

        ``dataset_fn`` may return a torch ``DataLoader`` (or an iterable of batches) that reads this
        replica's share itself, e.g. over an ``IterableDataset`` that shards by rank.
        """
        context = self.input_context()
        dataset = dataset_fn(context)
        if not isinstance(dataset, Dataset) and hasattr(dataset, "__iter__"):
            return PerReplicaLoader(dataset, context)
        return DistributedDataset.from_per_replica(dataset, context)

    def verify_replicas(self, model: Any, optimizer: Any = None) -> StateDigest:
        """Prove that every replica holds the same state: compare each replica's digest (collective).

        Under data parallel, every tensor of the state is compared (weights, optimizer state, step
        count, buffers); under layouts, the replicas of each shard are (those along ``batch``).
        ``torch.nn.BatchNorm*d`` running statistics, which DDP trains from rank 0's copy, are
        compared once every replica has rank 0's; ``meshfit.nn.SyncBatchNorm``'s as they are.
        "Differs" means differs in bits; the digests are computed on the device (no host copy).

        Args:
            model: a `meshfit.Model` (its optimizer is included) or a ``torch.nn.Module``.
            optimizer: a meshfit or torch optimizer whose state is compared too (default: the
                Model's own).

        Returns:
            The state's digest (`meshfit.train.state_digest`'s), equal on every process.

        Raises:
            ReplicaDivergenceError: on every rank, naming the step, the first differing tensor's
                path and the ranks that differ from the most common value (both of two).
            ValueError: the model holds no tensors.

        Example:
            >>> import torch, meshfit as mf
            >>> digest = mf.OneDeviceStrategy("cpu").verify_replicas(torch.nn.Linear(2, 1))
            >>> sorted(digest)
            ['bias', 'weight']
        """
        return verify_replicas(self, model, optimizer)

    def check_alive(self) -> None:
        """Raise if a peer is known to have stopped (distributed strategies watch heartbeats)."""

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """A region in which peers are watched (training, evaluation, saving); no-op here."""
        yield

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={str(self.device)!r})"


class OneDeviceStrategy(Strategy):
    """Everything on one device, as ``tf.distribute.OneDeviceStrategy``.

    Args:
        device: ``"cpu"``, ``"cuda:0"``... (default: the first GPU if any, else the CPU).

    Example:
        >>> OneDeviceStrategy("cpu").num_replicas_in_sync
        1
    """


def get_strategy() -> DistributionStrategy:
    """The strategy whose scope we are in, else the global distribution's (``mf.distribution``), else
    the default one-device strategy."""
    if _SCOPE_STACK:
        return _SCOPE_STACK[-1]
    if _GLOBAL_DISTRIBUTION:
        return _GLOBAL_DISTRIBUTION[0].training_strategy()
    if not _DEFAULT:
        _DEFAULT.append(OneDeviceStrategy())
    return _DEFAULT[0]


use_default_strategy(get_strategy)


def _parse_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device.replace("/", "").lower() if isinstance(device, str) else device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"Invalid `device`: expected 'cpu', 'cuda' or 'cuda:N', received device={device!r}.") \
            from error
    if parsed.type == "cpu":
        return torch.device("cpu")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"Invalid `device`: {device!r} asks for a GPU but none is available here. "
                         "Use 'cpu'.")
    return parsed
