"""Which strategy is current: the scope stack, the default strategy, and the running multi-replica ones.

Kept apart from the strategy classes so that the modules that consult it (parameter replication,
metrics, loss scaling) import no strategy class, and the strategies import them without a cycle.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from meshfit.distribute._strategy import Strategy

_SCOPE_STACK: list[Strategy] = []
_DEFAULT: list[Strategy] = []  # the default one-device strategy, made on first use by get_strategy()
# multi-replica strategies whose process group is up (to refuse training a model made outside them)
_RUNNING: weakref.WeakSet = weakref.WeakSet()


def current_scope_strategy() -> Strategy | None:
    """The strategy whose scope we are in, or None outside every scope."""
    return _SCOPE_STACK[-1] if _SCOPE_STACK else None


def is_default_strategy(strategy: Strategy) -> bool:
    """Whether ``strategy`` is the default one (what code outside every scope gets)."""
    return bool(_DEFAULT) and strategy is _DEFAULT[0]


def register_running(strategy: Strategy) -> None:
    """Called by a multi-replica strategy once its process group is up."""
    _RUNNING.add(strategy)


def running_multi_replica_strategy() -> Strategy | None:
    """A strategy with several replicas in sync whose group is still up in this process, if any."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    for strategy in list(_RUNNING):
        if strategy.num_replicas_in_sync > 1:
            return strategy
    return None
