"""Replicas proven identical: the training state's digest per tensor, compared across replicas.

``named_state`` lists what a replica holds (the module's parameters and buffers by path, the
optimizer's state as ``optimizer/<param path>/<state name>`` and its step count); every process
computes its part of each tensor's layout-independent digest (`meshfit.distribute._proof._digest`) on the
device; ``compare_replicas`` finds the first tensor whose replicas differ, and the ranks that
differ from the most common value (all of them when no value is the most common: both of two).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import is_lazy

from meshfit._lazy_dtensor import is_dtensor
from meshfit._protocols import DistributionStrategy, Residency
from meshfit.distribute._buffers import agree_buffers
from meshfit.distribute._proof._digest import LocalPart, combine_digests, finish_digest
from meshfit.distribute._proof._digest_batch import local_parts
from meshfit.distribute._proof._one_copy import coverage, gathered_digests
from meshfit.distribute._residency import EVERYWHERE


class ReplicaDivergenceError(ValueError):
    """Replicas that should hold the same state do not: every differing tensor and the ranks.

    Attributes:
        step: the optimizer step at which the difference was found.
        path: the first differing tensor (``optimizer/<param path>/<state name>`` for optimizer
            state; a checkpoint's tensor key when found while saving).
        ranks: the ranks whose digest differs from the most common one (all of them when no value
            is the most common, so both of two).
        differing: ``(path, ranks)`` of every differing tensor, the first one first.
        last_equal: the last step at which each differing tensor was seen equal on every replica
            (by the same checker: `VerifyReplicas`, or the strategy's ``verify_replicas``), where known.
    """

    def __init__(self, step: int, path: str, ranks: Sequence[int], detail: str = "", prefix: str = "",
                 differing: Sequence[tuple[str, Sequence[int]]] = (),
                 last_equal: Mapping[str, int] | None = None) -> None:
        self.step, self.path, self.ranks, self.detail = int(step), str(path), list(ranks), detail
        self.prefix = prefix
        self.differing = [(str(p), list(r)) for p, r in differing] or [(self.path, self.ranks)]
        self.last_equal = {str(p): int(s) for p, s in (last_equal or {}).items()}
        super().__init__(f"{prefix}Replicas diverged at step {self.step}: {self.path!r} differs on rank(s) "
                         f"{', '.join(map(str, self.ranks))}{self._seen(self.path)}{detail}{self._others()}")

    def _seen(self, path: str) -> str:
        return f" (last seen equal at step {self.last_equal[path]})" if path in self.last_equal else ""

    def _others(self) -> str:
        others = [f"{p!r} on rank(s) {', '.join(map(str, r))}{self._seen(p)}" for p, r in self.differing[1:]]
        return f" {len(others)} more tensor(s) differ: {'; '.join(others)}." if others else ""

    def with_history(self, last_equal: Mapping[str, int]) -> ReplicaDivergenceError:
        """The same error, naming the step each differing tensor was last seen equal."""
        known = {path: last_equal[path] for path, _ in self.differing if path in last_equal}
        error = type(self)(self.step, self.path, self.ranks, self.detail, self.prefix, self.differing, known)
        error.__cause__ = self.__cause__
        return error

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.step, self.path, self.ranks, self.detail, self.prefix, self.differing,
                            self.last_equal)


class StateDigest(Mapping[str, int]):
    """Each tensor's 64-bit digest by path (unsigned ints), and ``total``: the whole state's.

    Attributes:
        total: the whole state's digest.
        compared: the paths whose copies a replica check compared (all of them for a digest
            that compared nothing: `meshfit.train.state_digest`'s).
        one_copy: the paths a replica check found held in one copy: not compared across replicas.
    """

    def __init__(self, digests: dict[str, int], compared: Sequence[str] | None = None,
                 one_copy: Sequence[str] = ()) -> None:
        self._digests = dict(digests)
        self.total = combine_digests(self._digests)
        self.compared = tuple(self._digests) if compared is None else tuple(compared)
        self.one_copy = tuple(one_copy)

    def __getitem__(self, path: str) -> int:
        return self._digests[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"StateDigest({len(self)} tensors, total=0x{self.total:016x})"


@runtime_checkable
class _HoldsModule(Protocol):
    """A meshfit ``Model`` (or any trainable): the user's module, and its optimizer."""

    module: torch.nn.Module
    optimizer: Any


@runtime_checkable
class _Resident(Protocol):
    """A meshfit ``Model``: its placement's `Residency`."""

    @property
    def residency(self) -> Residency: ...


@runtime_checkable
class _StepCounted(Protocol):
    """A meshfit optimizer: whether it is built, and its step count (checked without building it)."""

    built: bool
    iterations: int


class _WrapsTorchOptimizer(_StepCounted, Protocol):
    """A built meshfit optimizer: the torch optimizer it holds."""

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer: ...


@runtime_checkable
class _SynchronizedNorm(Protocol):
    """A batch norm whose statistics are the global batch's (meshfit's or torch's ``SyncBatchNorm``)."""

    process_group: Any


def resolve_state(model: Any, optimizer: Any = None) -> tuple[torch.nn.Module, Any]:
    """The module and the optimizer a digest covers (a meshfit Model brings its own optimizer)."""
    if isinstance(model, torch.nn.Module):
        module = model
    elif isinstance(model, _HoldsModule) and isinstance(model.module, torch.nn.Module):
        module = model.module
        if optimizer is None:
            optimizer = model.optimizer
    else:
        raise TypeError(f"Invalid `model`: expected a meshfit.Model or a torch.nn.Module, received "
                        f"{type(model).__name__}. Pass the model whose state the replicas share.")
    if optimizer is not None and not isinstance(optimizer, (torch.optim.Optimizer, _StepCounted)):
        raise TypeError(f"Invalid `optimizer`: expected a meshfit or torch optimizer (or None), received "
                        f"{type(optimizer).__name__}.")
    return module, optimizer


def named_state(module: torch.nn.Module, optimizer: Any = None, residency: Residency = EVERYWHERE,
                ) -> tuple[list[tuple[str, torch.Tensor]], set[str]]:
    """The state's tensors by path, in a fixed order, and the paths DDP agrees on rank 0's copy
    (plain batch-norm running statistics; synchronized batch norms' are compared as they are).
    Only the paths this rank holds (``residency``: a pipeline stage holds its own)."""
    lazy = [name for name, p in module.named_parameters() if is_lazy(p)]
    if lazy:
        raise ValueError(f"Invalid `model`: {type(module).__name__} holds no tensors yet: {lazy[0]!r} is a lazy "
                         "parameter, not built. Call the model on a batch (or fit it) before asking for its digest.")
    state: list[tuple[str, torch.Tensor]] = [(k, v) for k, v in module.state_dict().items()
                                             if isinstance(v, torch.Tensor)]
    agreed = {f"{prefix}.{name}" if prefix else name
              for prefix, child in module.named_modules()
              if isinstance(child, _BatchNorm) and not isinstance(child, _SynchronizedNorm)
              for name, _ in child.named_buffers(recurse=False)}
    if optimizer is not None:
        state += _optimizer_state(module, optimizer)
    if not residency.everywhere:
        state = [(path, tensor) for path, tensor in state if residency.holds(path)]
    if not state:
        raise ValueError(f"Invalid `model`: {type(module).__name__} holds no tensors (no parameters or buffers, "
                         "and no optimizer state), so there is no state to digest. Pass the model after it is "
                         "built (a lazy module is built by its first call or by fit).")
    return state, agreed & {path for path, _ in state}


def _optimizer_state(module: torch.nn.Module, optimizer: Any) -> list[tuple[str, torch.Tensor]]:
    state: list[tuple[str, torch.Tensor]] = []
    if isinstance(optimizer, _StepCounted) and not isinstance(optimizer, torch.optim.Optimizer):
        if not optimizer.built:
            return state
        state.append(("optimizer/iterations", torch.tensor(int(optimizer.iterations), dtype=torch.int64)))
        optimizer = cast(_WrapsTorchOptimizer, optimizer).torch_optimizer
    names = {id(p): name for name, p in module.named_parameters()}
    index = 0
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            name = names.get(id(parameter), f"param{index}")
            index += 1
            for key, value in sorted(optimizer.state.get(parameter, {}).items(), key=lambda kv: str(kv[0])):
                if isinstance(value, torch.Tensor):
                    state.append((f"optimizer/{name}/{key}", value))
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    dtype = torch.float64 if isinstance(value, float) else torch.int64
                    state.append((f"optimizer/{name}/{key}", torch.tensor(value, dtype=dtype)))
    return state


def reduce_parts(paths: Sequence[str], values: Sequence[int], parts: Sequence[LocalPart],
                 world: Any) -> dict[str, int]:
    """Every tensor's digest, equal on every process: one copy of each shard summed (control plane)."""
    masked = torch.tensor([v if p.canonical else 0 for v, p in zip(values, parts, strict=True)], dtype=torch.int64)
    if world.distributed:
        world.control_all_reduce(masked)
    return {path: finish_digest(int(v), p.meta) for path, v, p in zip(paths, masked.tolist(), parts, strict=True)}


def reduce_resident(state: Sequence[tuple[str, torch.Tensor]], residency: Residency, world: Any) -> dict[str, int]:
    """Every tensor's digest where each rank holds some paths (``residency``): each path's parts summed
    over the ranks that hold it, one copy of each shard (one gather on the control plane)."""
    values, parts = local_parts([t for _, t in state], world.rank)
    mine = {path: (value, _counts(path, tensor, part, residency, world.rank), part.meta)
            for (path, tensor), value, part in zip(state, values, parts, strict=True)}
    gathered = world.all_gather_object(mine) if world.distributed else [mine]
    every_path = list(dict.fromkeys(p for held in gathered for p in held))
    return {path: finish_digest(sum(g[path][0] for g in gathered if path in g and g[path][1]),
                                next(g[path][2] for g in gathered if path in g)) for path in every_path}


def find_divergences(paths: Sequence[str], gathered: Sequence[tuple[list[int], list[Any]]],
                     skip: frozenset[str] = frozenset()) -> list[tuple[str, list[int], str]]:
    """Every path whose copies differ among the ranks holding the same shard, in path order: the path,
    the ranks that differ (the minority; all when no value is most common) and each rank's digest.
    Every rank holds every path (``gathered[rank]``: its digests and shards, by path index)."""
    held = [{path: (values[i], shards[i]) for i, path in enumerate(paths)} for values, shards in gathered]
    return divergences_by_path(paths, held, skip)


def divergences_by_path(paths: Sequence[str], held: Sequence[Mapping[str, tuple[int, Any]]],
                        skip: frozenset[str] = frozenset()) -> list[tuple[str, list[int], str]]:
    """`find_divergences` where each rank holds some paths (``held[rank]``: path → its digest and shard):
    each path's copies are compared among the ranks that hold it (a pipeline's stage), never across."""
    found = []
    for path in paths:
        if path in skip:
            continue
        groups: dict[Any, list[int]] = collections.defaultdict(list)
        for rank, mine in enumerate(held):
            if path in mine:
                groups[tuple(mine[path][1])].append(rank)
        for ranks in groups.values():
            values = {rank: held[rank][path][0] & ((1 << 64) - 1) for rank in ranks}
            counts = collections.Counter(values.values()).most_common()
            if len(counts) < 2:
                continue
            if counts[0][1] > counts[1][1]:
                odd = [rank for rank in ranks if values[rank] != counts[0][0]]
            else:
                odd = list(ranks)
            found.append((path, odd, ", ".join(f"rank {r}: 0x{v:016x}" for r, v in values.items())))
            break
    return found


def compare_replicas(paths: Sequence[str], gathered: Sequence[tuple[list[int], list[Any]]],
                     skip: frozenset[str] = frozenset()) -> tuple[str, list[int], str] | None:
    """The first path whose copies differ among the ranks holding the same shard (`find_divergences`)."""
    found = find_divergences(paths, gathered, skip)
    return found[0] if found else None


class ReplicaHistory:
    """The last step at which each path was seen equal on every replica, by one checker."""

    def __init__(self) -> None:
        self.last_equal: dict[str, int] = {}

    def passed(self, step: int, paths: Sequence[str]) -> None:
        self.last_equal.update(dict.fromkeys(paths, int(step)))


def _step_of(strategy: DistributionStrategy, optimizer: Any) -> int:
    return optimizer.iterations if isinstance(optimizer, _StepCounted) else (strategy.failure.step or 0)


def resolve_residency(model: Any) -> Residency:
    """The `Residency` of a meshfit Model's placement (which ranks hold which paths); a plain module's
    state is held by every rank."""
    return model.residency if isinstance(model, _Resident) else EVERYWHERE


def verify_replicas(strategy: DistributionStrategy, model: Any, optimizer: Any = None,
                    history: ReplicaHistory | None = None) -> StateDigest:
    """Compare every replica's digest of the state it should share (see `Strategy.verify_replicas`).

    Each rank digests the paths it holds (its placement's `Residency`); each path is compared among
    the ranks that hold it. One-copy parameters (`meshfit.distribute._proof._one_copy`) are also gathered
    on every rank and the digest of what each rank got compared with the digest of the shards, in
    the same gather.
    """
    residency = resolve_residency(model)
    module, optimizer = resolve_state(model, optimizer)
    state, agreed = named_state(module, optimizer, residency)
    world = strategy.world
    paths = [path for path, _ in state]
    parameters = {name for name, _ in module.named_parameters()}
    covered = coverage(state, parameters, world.size if world.distributed else 1, residency)
    gathered_paths = list(covered.gathered)
    by_name = dict(state)
    full = gathered_digests([by_name[p] for p in gathered_paths]) if gathered_paths else []
    first = [(p, t) for p, t in state if p not in agreed]
    values, parts = local_parts([t for _, t in first], world.rank)
    if agreed:  # DDP trains with rank 0's statistics: they are compared once every replica has rank 0's
        agree_buffers(module, strategy, residency)
    later = [(p, t) for p, t in state if p in agreed]
    more_values, more_parts = local_parts([t for _, t in later], world.rank)
    by_path = dict(zip([p for p, _ in first] + [p for p, _ in later],
                       zip(values + more_values, parts + more_parts, strict=True), strict=True))
    mine = ({p: (by_path[p][0], list(by_path[p][1].shard), _counts(p, by_name[p], by_path[p][1], residency,
                                                                 world.rank), by_path[p][1].meta) for p in paths},
            dict(zip(gathered_paths, full, strict=True)))
    gathered = world.all_gather_object(mine) if world.distributed else [mine]
    every_path = list(dict.fromkeys(p for held, _ in gathered for p in held))  # the chief's first, in order
    step = _step_of(strategy, optimizer)
    held = [{p: (v, shard) for p, (v, shard, _, _) in g[0].items()} for g in gathered]
    found = divergences_by_path(every_path, held)
    metas = {p: meta for g in reversed(gathered) for p, (_, _, _, meta) in g[0].items()}
    digests = {path: finish_digest(sum(g[0][path][0] for g in gathered if path in g[0] and g[0][path][2]),
                                   metas[path]) for path in every_path}
    found += _bad_gathers(digests, [g[1] for g in gathered])
    if found:
        path, ranks, detail = found[0]
        last_equal = history.last_equal if history is not None else {}
        raise ReplicaDivergenceError(step, path, ranks, f" (each rank's digest of its copy: {detail}).",
                                     differing=[(p, r) for p, r, _ in found],
                                     last_equal={p: last_equal[p] for p, _, _ in found if p in last_equal})
    compared = _with_copies(every_path, held)
    if history is not None:
        history.passed(step, compared + covered.gathered)
    return StateDigest(digests, compared=compared, one_copy=tuple(p for p in every_path if p not in set(compared)))


def _counts(path: str, tensor: torch.Tensor, part: LocalPart, residency: Residency, rank: int) -> bool:
    """Whether this rank's part counts in ``path``'s digest: a plain tensor's first holder's copy (rank 0's
    when every rank holds it), a DTensor's by its layout."""
    holders = residency.holders(path)
    if not holders:
        return part.canonical
    if is_dtensor(tensor):  # a stage's shard (fully sharded stages): one copy of it among the stage's holders
        return _first_copy_among(tensor, holders[0])
    return rank == holders[0]


def _first_copy_among(tensor: Any, first: int) -> bool:
    """Whether this rank's shard of ``tensor`` is the copy that counts: the one in the mesh instance that
    holds rank ``first`` (the path's first holder), at coordinate 0 of every axis it is replicated on."""
    from torch.distributed.tensor.placement_types import Replicate

    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate() or ()
    return bool((mesh.mesh == first).any()) and all(
        c == 0 for c, p in zip(coordinate, tensor.placements, strict=True) if isinstance(p, Replicate))


def _with_copies(paths: Sequence[str], held: Sequence[Mapping[str, tuple[int, Any]]]) -> tuple[str, ...]:
    """The paths every shard of which two or more ranks hold (what comparing copies covers)."""
    compared = []
    for path in paths:
        counts = collections.Counter(tuple(mine[path][1]) for mine in held if path in mine)
        if min(counts.values()) > 1:
            compared.append(path)
    return tuple(compared)


def _bad_gathers(digests: Mapping[str, int],
                 gathered: Sequence[Mapping[str, int]]) -> list[tuple[str, list[int], str]]:
    """The one-copy parameters some rank gathered into another value than its shards hold."""
    found = []
    paths = list(dict.fromkeys(p for mine in gathered for p in mine))
    for path in paths:
        want = digests[path]
        odd = [rank for rank, mine in enumerate(gathered) if path in mine and mine[path] != want]
        if odd:
            detail = ", ".join(f"rank {r}: 0x{mine[path]:016x}" for r, mine in enumerate(gathered) if path in mine)
            found.append((f"{path} (gathered)", odd,
                          f"{detail}; its shards' digest: 0x{want:016x}"))
    return found
