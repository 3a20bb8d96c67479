"""Which strategy is current: the scope stack, the default strategy, and the world of this process.

Kept apart from the strategy classes so that the modules that consult it (parameter replication,
metrics, loss scaling) import no strategy class, and the strategies import them without a cycle.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from meshfit._protocols import DistributionStrategy as Strategy
from meshfit._protocols import StrategySource
from meshfit.distribute._world import World

_SCOPE_STACK: list[Strategy] = []
_DEFAULT: list[Strategy] = []  # the default one-device strategy, made on first use by get_strategy()
# The `World` of this process's job while its group is up (None alone): as torch's default group,
# one per process. Consulted to refuse training a model made outside every scope.
_PROCESS_WORLD: list[Any] = []
# Keras 3's global distribution (``meshfit.distribution.set_distribution``): consulted by get_strategy()
# outside every strategy scope, its strategy made on first use.
_GLOBAL_DISTRIBUTION: list[StrategySource] = []


def set_global_distribution(source: StrategySource | None) -> None:
    """Make ``source`` the distribution that code outside every strategy scope trains with (None: none)."""
    _GLOBAL_DISTRIBUTION[:] = [] if source is None else [source]


def global_distribution() -> StrategySource | None:
    """The distribution set by ``meshfit.distribution.set_distribution``, or None."""
    return _GLOBAL_DISTRIBUTION[0] if _GLOBAL_DISTRIBUTION else None


def current_scope_strategy() -> Strategy | None:
    """The strategy whose scope we are in, or None outside every scope."""
    return _SCOPE_STACK[-1] if _SCOPE_STACK else None


def is_default_strategy(strategy: Strategy) -> bool:
    """Whether ``strategy`` is the default one (what code outside every scope gets)."""
    return bool(_DEFAULT) and strategy is _DEFAULT[0]


def set_process_world(world: Any) -> None:
    """Called by a strategy once the group of ``world`` is up."""
    _PROCESS_WORLD[:] = [world]


def clear_process_world(world: Any) -> None:
    """Called when ``world`` shuts down."""
    if _PROCESS_WORLD and _PROCESS_WORLD[0] is world:
        _PROCESS_WORLD.clear()


def process_world() -> Any:
    """The `World` of this process's job while its group of several processes is up, else None."""
    if not _PROCESS_WORLD or not dist.is_available() or not dist.is_initialized():
        return None
    return _PROCESS_WORLD[0]


def current_world() -> Any:
    """The `World` collectives should run in: this job's, or one made for a group the user initialised
    without a strategy (collective then: every rank calls this at the same point), else a single one."""
    from_job = process_world()
    if from_job is not None:
        return from_job
    formed = World.process_group_shape()
    if formed is not None and formed[1] > 1:
        world = World.of_process_group()
        set_process_world(world)
        return world
    return World.single()
