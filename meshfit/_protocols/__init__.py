"""The contracts between meshfit's modules, as ``typing.Protocol``s.

The training loop (`meshfit._engine._loop`), the callbacks and the checkpoint saver are written against
these, never against `Model` or a concrete strategy: `Model` and the Estimator are two
`Trainable`s; `OneDeviceStrategy`, the mirrored strategies and a layout mesh are
`DistributionStrategy`s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from meshfit._protocols._placement import GradientSyncLike as GradientSyncLike
from meshfit._protocols._placement import PlacementLike as PlacementLike
from meshfit._protocols._placement import Residency as Residency
from meshfit._protocols._placement import ShapesModule as ShapesModule
from meshfit._protocols._placement import StepHost as StepHost
from meshfit._protocols._placement import StepOutputs as StepOutputs
from meshfit._protocols._placement import StepRunner as StepRunner

if TYPE_CHECKING:
    import torch
    from torch import nn


class ClusterResolverLike(Protocol):
    """TF's cluster identity of a process (see `meshfit.cluster.ClusterResolver`)."""

    @property
    def task_type(self) -> str | None: ...

    @property
    def task_id(self) -> int | None: ...

    @property
    def synthetic(self) -> bool: ...  # meshfit made it up (nothing described a cluster): read the environment


class CheckpointRecordLike(Protocol):
    """Where a custom loop's checkpoints are, for failure messages (a `meshfit.train.CheckpointManager`)."""

    @property
    def directory(self) -> str: ...

    @property
    def latest_checkpoint(self) -> str | None: ...

    @property
    def current_step(self) -> int | None: ...  # its step counter's value, None without one


class FailureStateLike(Protocol):
    """What the loop and savers record for failure messages (see `meshfit.distribute.FailureState`)."""

    step: int | None
    backup_dir: str | None
    terminating: bool  # SIGTERM received: a broken collective ends the worker at once

    def register_checkpoints(self, record: CheckpointRecordLike) -> None: ...


class InputContextLike(Protocol):
    """A data shard's identity (see `meshfit.InputContext`)."""

    @property
    def num_input_pipelines(self) -> int: ...

    @property
    def input_pipeline_id(self) -> int: ...

    @property
    def num_replicas_in_sync(self) -> int: ...


@runtime_checkable
class Stateful(Protocol):
    """Anything saved: ``torch.distributed.checkpoint``'s ``Stateful`` contract."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class ChoosesSavedRank(Protocol):
    """A per-rank trackable that chooses which saved rank's state it restores (`meshfit.train.PerRank`):
    each saved rank's ``role`` (from its state's ``"role"`` entry, None when it has none) in saved-rank order;
    returns the index of the state to load. Without it, rank ``r`` loads saved rank ``r % saved``."""

    def choose_saved(self, roles: Sequence[str | None], rank: int) -> int: ...


class MetricLike(Protocol):
    """What the loop needs of a metric (see `meshfit.metrics.Metric`)."""

    name: str

    def update_state(self, *args: Any, **kwargs: Any) -> None: ...

    def state_tensors(self) -> tuple[torch.Tensor, ...]: ...

    def result(self) -> torch.Tensor: ...

    def result_from(self, states: tuple[torch.Tensor, ...]) -> torch.Tensor: ...

    def reset_state(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class LayoutMapLike(Protocol):
    """The layouts a mesh strategy applies to the modules it sets up (see `meshfit.dtensor.LayoutMap`)."""

    @property
    def is_fully_sharded(self) -> bool: ...  # ``LayoutMap.fully_sharded``: every weight sharded (FSDP)


class DistributionStrategy(Protocol):
    """How a step runs: placement of modules and batches, and reductions over the data-parallel axis.

    The order of module transforms lives in ``setup_module`` (layouts, then DDP); it runs before
    the optimizer is built, because a layout replaces parameters.
    """

    @property
    def num_replicas_in_sync(self) -> int: ...

    @property
    def replica_id(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def is_chief(self) -> bool: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def world(self) -> Any: ...  # the `meshfit.distribute.World` it runs on (a checkpoint's too)

    @property
    def failure(self) -> FailureStateLike: ...

    @property
    def cluster_resolver(self) -> ClusterResolverLike: ...  # TF's task_type / task_id / cluster_spec() (SPEC)

    @property
    def layout_map(self) -> LayoutMapLike | None: ...  # a mesh strategy's layouts (None: replicated)

    def places_on_creation(self, module: nn.Module) -> bool: ...  # `Model(module)` places it at once

    def scope(self) -> AbstractContextManager[Any]: ...

    def setup_module(self, module: nn.Module, jit_compile: bool = False) -> PlacementLike: ...

    def distribute_batch(self, batch: Any) -> Any: ...

    def input_context(self) -> InputContextLike: ...

    def batch_weight(self, local_size: int, global_size: int) -> AbstractContextManager[None]: ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_reduce_states(self, tensor: torch.Tensor, flags: int = 0,  # logs: one collective
                          lead: bool | None = None) -> torch.Tensor: ...

    def all_reduce_control(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def broadcast_tensor(self, tensor: torch.Tensor) -> torch.Tensor: ...  # rank 0's values, in place

    def broadcast_object(self, obj: Any) -> Any: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def barrier(self) -> None: ...

    def check_alive(self) -> None: ...

    def guard(self) -> AbstractContextManager[None]: ...

    def verify_replicas(self, model: Any, optimizer: Any = None) -> Any: ...  # the state's digest, or raises

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any: ...

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any: ...

    def distribute_datasets_from_function(self, dataset_fn: Callable[[Any], Any], options: Any = None) -> Any: ...


class MeshStrategyLike(DistributionStrategy, Protocol):
    """The strategy of a mesh made by ``create_mesh`` (see `meshfit.dtensor.Mesh.strategy`)."""

    @property
    def local_device_count(self) -> int: ...  # the mesh's devices on this host

    @property
    def local_device_index(self) -> int: ...  # this process's position among them

    def with_layout_map(self, layout_map: Any) -> MeshStrategyLike: ...  # same processes, applying the layouts


class StrategySource(Protocol):
    """A Keras 3 distribution (``meshfit.distribution``): set globally, it gives the strategy that code
    outside every strategy scope trains with (made, and its processes formed, on first use)."""

    def training_strategy(self) -> DistributionStrategy: ...


class PreemptionHandler(Protocol):
    """A callback that saves when the cluster is about to stop this job (see `BackupAndRestore`).

    The loop watches for preemption only when some callback ``handles_preemption``; at an agreed
    step it calls ``save_for_preemption`` on those that do.
    """

    @property
    def handles_preemption(self) -> bool: ...

    def save_for_preemption(self) -> None: ...


@runtime_checkable
class RestoresTraining(Protocol):
    """A callback that resumes training from its saved state (`BackupAndRestore`, `CheckpointSaver`).

    `TrainingLoop.run` calls ``restore_training`` on the one such callback of its list after the
    metrics are reset and before any callback hook (``on_train_begin`` included), so every callback
    sees the restored weights, optimizer and counters. Several in one list are an error.
    """

    def restore_training(self, loop: LoopLike) -> bool: ...  # whether a checkpoint was restored


class CallbackLike(PreemptionHandler, Protocol):
    """What the loop and `CallbackList` read of one callback (see `meshfit.callbacks.Callback`)."""

    @property
    def reads_batch_logs(self) -> bool: ...  # whether on_train_batch_end reads its logs

    @property
    def run_last(self) -> bool: ...  # runs after every other callback in each hook (savers)


class DataSource(Protocol):
    """The random-access data protocol the loop reads (see `meshfit.distribute.DistributedDataset`).

    A position is ``(pass_index, index)``: batch ``index`` of pass ``pass_index``, computed directly.
    """

    def length(self) -> int | None: ...  # global batches per pass, None when infinite

    def replica_batch(self, index: int, pass_index: int) -> tuple[Any, int]: ...  # (this replica's rows, global size)

    def prefetch_size(self) -> int: ...  # batches to compute ahead (0: none)

    @property
    def replicas_read_different_rows(self) -> bool: ...  # False when every replica reads the same examples

    @property
    def replays_exactly(self) -> bool: ...  # a pass read again yields the same batches (exact resumes)

    def state_dict(self) -> dict[str, Any]: ...


class Trainable(Protocol):
    """What the loop drives: `Model` implements it; the Estimator implements it too.

    ``build`` materialises lazy modules, places them through the strategy and builds the optimizer.
    The steps take this replica's batch, already placed by ``strategy.distribute_batch``.
    ``saveable_parts`` are the trainable's own pieces of a backup (module weights, optimizer...);
    the loop adds its own (counters, data position, callbacks, metrics, RNG streams).
    """

    @property
    def strategy(self) -> DistributionStrategy: ...

    stop_training: bool
    stop_evaluating: bool  # set in a test batch hook: evaluate ends after that batch (Keras 3)
    stop_predicting: bool  # set in a predict batch hook: predict ends after that batch (Keras 3)
    steps_per_execution: int  # training steps between two batch-callback calls

    @property
    def module(self) -> nn.Module: ...

    @property
    def metrics(self) -> Sequence[MetricLike]: ...

    def build(self, sample: Any) -> None: ...

    def train_step(self, batch: Any) -> Mapping[str, Any] | None: ...

    def test_step(self, batch: Any) -> Mapping[str, Any] | None: ...

    def predict_step(self, batch: Any) -> Any: ...

    def reset_metrics(self) -> None: ...

    def finish_training(self) -> None:
        """Called once training ends, before ``on_train_end`` (e.g. swap in moving averages)."""

    def saveable_parts(self) -> Mapping[str, Stateful]: ...

    @property
    def residency(self) -> Residency: ...  # its placement's: who holds which state and the outputs

    def logged_metrics(self) -> Sequence[MetricLike]: ...


class CallbackListLike(Protocol):
    """The loop's view of its callbacks (see `meshfit.callbacks.CallbackList`)."""

    def __iter__(self) -> Iterator[CallbackLike]: ...

    def set_loop(self, loop: LoopLike) -> None: ...

    def batch_logs_needed(self) -> bool: ...

    def restorer(self) -> RestoresTraining | None: ...  # the callback that resumes training, if any

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None: ...

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None: ...

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None: ...

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None: ...

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None: ...

    def on_test_end(self, logs: dict[str, Any] | None = None) -> None: ...

    def on_test_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...

    def on_test_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...

    def on_predict_begin(self, logs: dict[str, Any] | None = None) -> None: ...

    def on_predict_end(self, logs: dict[str, Any] | None = None) -> None: ...

    def on_predict_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...

    def on_predict_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ModelLike(Trainable, Protocol):
    """What callbacks use of a Keras-style model (see `meshfit.Model`)."""

    optimizer: Any
    history: Any

    def get_weights(self) -> list[Any]: ...

    def set_weights(self, weights: list[Any]) -> None: ...

    def save(self, filepath: str, *args: Any, **kwargs: Any) -> None: ...

    def save_weights(self, filepath: str, *args: Any, **kwargs: Any) -> None: ...


class LoopLike(Stateful, Protocol):
    """What callbacks use of the running training loop (see `meshfit._engine.TrainingLoop`)."""

    trainable: Trainable
    strategy: DistributionStrategy
    counters: Any
    data: Any
    callbacks: CallbackListLike

    def checkpoint_items(self) -> dict[str, Stateful]: ...

    def snapshot(self) -> Any: ...

    def resume(self, candidates: Sequence[str], *, fall_back: bool = True) -> str | None: ...

    def agree(self, flag: bool) -> bool: ...

    def agree_buffers(self) -> None: ...
