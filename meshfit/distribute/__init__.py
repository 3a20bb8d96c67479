"""Strategies: how a training step runs on one or many devices and workers."""

from meshfit._export import publish as _publish
from meshfit.distribute._buffers import agree_buffers as agree_buffers  # a seam (not in __all__)
from meshfit.distribute._collective import CollectiveStrategy
from meshfit.distribute._gradient_sync import DataParallelSync as DataParallelSync
from meshfit.distribute._gradient_sync import ReplicatedSync as ReplicatedSync
from meshfit.distribute._gradient_weight import GradientWeight as GradientWeight
from meshfit.distribute._gradient_weight import scale_accumulated_gradients as scale_accumulated_gradients
from meshfit.distribute._input._distributed_dataset import DistributedDataset
from meshfit.distribute._input._torch_loader import LoaderPlan as LoaderPlan
from meshfit.distribute._input._torch_loader import PerReplicaLoader as PerReplicaLoader
from meshfit.distribute._liveness._failure import FailureState as FailureState
from meshfit.distribute._liveness._heartbeat import PEER_FAILURE_EXIT_CODE, PeerFailureError
from meshfit.distribute._liveness._rendezvous import agree_on_settings as agree_on_settings
from meshfit.distribute._mirrored import MirroredStrategy

# Seams for meshfit's other packages (not public API: not in __all__).
from meshfit.distribute._mirrored import form_local_world as form_local_world
from meshfit.distribute._mirrored import local_devices as local_devices
from meshfit.distribute._multi_worker import MultiWorkerMirroredStrategy
from meshfit.distribute._multi_worker import form_cluster_world as form_cluster_world
from meshfit.distribute._parallel_dims import AxisRole as AxisRole
from meshfit.distribute._parallel_dims import ParallelDims as ParallelDims
from meshfit.distribute._parallel_dims import data_axis_of as data_axis_of
from meshfit.distribute._placement import GradientSync, Placement
from meshfit.distribute._placement import PlacementHook as PlacementHook
from meshfit.distribute._placement import PlacementPlan as PlacementPlan
from meshfit.distribute._placement import Transform as Transform
from meshfit.distribute._placement import gradient_reduced as gradient_reduced
from meshfit.distribute._placement import mark_reduced as mark_reduced
from meshfit.distribute._placement import placement_hook as placement_hook
from meshfit.distribute._placement import register_placement as register_placement
from meshfit.distribute._plan_builder import InPlace as InPlace  # the one builder of placements
from meshfit.distribute._plan_builder import MoveTo as MoveTo
from meshfit.distribute._plan_builder import compiled as compiled
from meshfit.distribute._plan_builder import place_data_parallel as place_data_parallel
from meshfit.distribute._plan_builder import place_laid_out as place_laid_out
from meshfit.distribute._plan_builder import place_replicated as place_replicated
from meshfit.distribute._plan_builder import place_sharded as place_sharded
from meshfit.distribute._plan_builder import place_staged as place_staged
from meshfit.distribute._proof._digest import combine_digests as combine_digests
from meshfit.distribute._proof._digest import finish_digest as finish_digest
from meshfit.distribute._proof._digest_batch import local_parts as local_parts
from meshfit.distribute._proof._one_copy import AtRest as AtRest
from meshfit.distribute._proof._one_copy import ReplicaCoverage as ReplicaCoverage
from meshfit.distribute._proof._one_copy import coverage as coverage
from meshfit.distribute._proof._one_copy import first_changed as first_changed
from meshfit.distribute._proof._verify import ReplicaDivergenceError, StateDigest
from meshfit.distribute._proof._verify import ReplicaHistory as ReplicaHistory
from meshfit.distribute._proof._verify import compare_replicas as compare_replicas
from meshfit.distribute._proof._verify import named_state as named_state
from meshfit.distribute._proof._verify import reduce_parts as reduce_parts
from meshfit.distribute._proof._verify import reduce_resident as reduce_resident
from meshfit.distribute._proof._verify import resolve_residency as resolve_residency
from meshfit.distribute._proof._verify import resolve_state as resolve_state
from meshfit.distribute._proof._verify import verify_replicas as verify_replicas
from meshfit.distribute._released import ReleasedParameter as ReleasedParameter
from meshfit.distribute._released import is_released as is_released
from meshfit.distribute._released import release_unheld as release_unheld
from meshfit.distribute._replica_context import (
    ReplicaContext,
    get_cross_replica_context,
    get_replica_context,
    in_cross_replica_context,
)
from meshfit.distribute._replica_context import in_replica_context as in_replica_context
from meshfit.distribute._replica_context import replica_context_scope as replica_context_scope
from meshfit.distribute._replication import adopt as adopt
from meshfit.distribute._replication import broadcast_initial_values as broadcast_initial_values
from meshfit.distribute._replication import check_training_strategy as check_training_strategy
from meshfit.distribute._replication import owner_of as owner_of
from meshfit.distribute._replication import synchronize_gradients as synchronize_gradients
from meshfit.distribute._replication import untracked as untracked
from meshfit.distribute._residency import EVERYWHERE as EVERYWHERE
from meshfit.distribute._residency import StageResidency as StageResidency
from meshfit.distribute._resident_state import resident_parts as resident_parts
from meshfit.distribute._scope import current_scope_strategy as current_scope_strategy
from meshfit.distribute._scope import current_world as current_world
from meshfit.distribute._scope import global_distribution as global_distribution
from meshfit.distribute._scope import process_world as process_world
from meshfit.distribute._scope import set_global_distribution as set_global_distribution
from meshfit.distribute._strategy import OneDeviceStrategy, Strategy, get_strategy
from meshfit.distribute._unused_parameters import ProbingDataParallel as ProbingDataParallel
from meshfit.distribute._values import (
    CommunicationImplementation,
    CommunicationOptions,
    InputContext,
    PerReplica,
    ReduceOp,
    ValueContext,
)
from meshfit.distribute._world import World

__all__ = [
    "GradientSync",
    "Placement",
    "World",
    "PEER_FAILURE_EXIT_CODE",
    "CollectiveStrategy",
    "CommunicationImplementation",
    "CommunicationOptions",
    "DistributedDataset",
    "InputContext",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "PeerFailureError",
    "PerReplica",
    "ReduceOp",
    "ReplicaContext",
    "ReplicaDivergenceError",
    "StateDigest",
    "Strategy",
    "ValueContext",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "in_cross_replica_context",
]

_publish(__name__)
