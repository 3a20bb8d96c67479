"""`Residency`: which ranks hold which state, and which hold the loss, metrics and predictions.

A placement declares it (`Placement.residency`), so that what reads state across ranks asks instead of
guessing from SPMD habits ("no DTensor" is not "every rank holds it" once a model is split into
pipeline stages):

- the replica check (`verify_replicas`, `VerifyReplicas`) digests only the paths this rank holds and
  compares each path among the ranks that hold it, never across stages; a path one rank alone holds
  is a one-copy tensor;
- a backup, ``model.save`` and ``get_weights`` complete a partly held state from its holders
  (`meshfit.distribute._resident_state`), so that a checkpoint has the layout of one process's and
  restores on any placement;
- the log reduction takes metric states from the ranks that hold the outputs (`leads_logs`).

`EVERYWHERE` is data parallel's, layouts' and fully sharded's: every rank holds (its shard or copy
of) every path, and every rank computes the loss. `StageResidency` is a pipeline's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from meshfit._protocols import Residency

_OPTIMIZER_PREFIX = "optimizer/"


@dataclasses.dataclass(frozen=True)
class _Everywhere:
    everywhere: bool = True
    holds_outputs: bool = True
    leads_logs: bool | None = None

    def holds(self, path: str) -> bool:
        return True

    def holders(self, path: str) -> Sequence[int]:
        return ()


#: Every rank holds every path; every rank computes the loss (data parallel, layouts, fully sharded).
EVERYWHERE: Residency = _Everywhere()


@dataclasses.dataclass(frozen=True)
class StageResidency:
    """A pipeline's residency: each stage's module paths, held by that stage's ranks.

    Args:
        rank: this process's global rank.
        stage_paths: per stage, the state paths (parameters and buffers) its module holds.
        stage_ranks: per stage, the global ranks that hold it (its replicas and shards).
        output_ranks: the ranks that compute the loss, metrics and predictions (the last stage's).
        log_ranks: the ranks that send metric states in the log reduction (one per data replica).
    """

    rank: int
    stage_paths: Sequence[frozenset[str]]
    stage_ranks: Sequence[tuple[int, ...]]
    output_ranks: frozenset[int]
    log_ranks: frozenset[int]
    everywhere: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self) -> None:
        if len(self.stage_paths) != len(self.stage_ranks):
            raise ValueError(f"Invalid stages: {len(self.stage_paths)} sets of paths for {len(self.stage_ranks)} "
                             "sets of ranks. Give one of each per stage.")
        owner: dict[str, int] = {}
        for stage, paths in enumerate(self.stage_paths):
            for path in paths:
                if path in owner:
                    raise ValueError(f"Invalid stages: {path!r} is held by stage {owner[path]} and by stage "
                                     f"{stage}. A state path belongs to one stage.")
                owner[path] = stage
        object.__setattr__(self, "_owner", owner)

    @property
    def holds_outputs(self) -> bool:
        return self.rank in self.output_ranks

    @property
    def leads_logs(self) -> bool | None:
        return self.rank in self.log_ranks

    def stage_of(self, path: str) -> int | None:
        """The stage that holds ``path`` (None: a path of no stage, which every rank holds)."""
        owner: Mapping[str, int] = self.__dict__["_owner"]
        return owner.get(module_path(path))

    def holds(self, path: str) -> bool:
        stage = self.stage_of(path)
        return stage is None or self.rank in self.stage_ranks[stage]

    def holders(self, path: str) -> Sequence[int]:
        stage = self.stage_of(path)
        return () if stage is None else tuple(sorted(self.stage_ranks[stage]))


def module_path(path: str) -> str:
    """The module path a state path is about: ``optimizer/<path>/<name>`` is about ``<path>``."""
    if path.startswith(_OPTIMIZER_PREFIX):
        inner = path[len(_OPTIMIZER_PREFIX):]
        return inner.rsplit("/", 1)[0] if "/" in inner else inner
    return path
