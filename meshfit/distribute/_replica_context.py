"""The replica context: what code running as one replica (inside ``strategy.run``) asks of its strategy.

As in TensorFlow, three places:

- inside ``strategy.run(fn)``: `get_replica_context` is that strategy's `ReplicaContext`, whose
  ``all_reduce`` / ``all_gather`` combine the replicas' values (a collective: every replica calls it);
- inside ``strategy.scope()`` but outside ``run`` (the cross-replica context): `get_replica_context`
  is ``None`` and `in_cross_replica_context` is True; ``strategy.reduce`` / ``gather`` combine there;
- outside every scope: the default replica context, of one replica. Its ``all_reduce`` returns the
  value, as TensorFlow's does, in a process alone. In a process of a multi-process job it refuses:
  TensorFlow's default context would hand back this worker's value alone, silently.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from meshfit.distribute._cross_replica import gather_structure, reduce_structure
from meshfit.distribute._scope import current_scope_strategy, process_world
from meshfit.distribute._values import ReduceOp, as_reduce_op, regroup
from meshfit.distribute._world import World


class _Alone:
    """The default context's reductions: one replica, whose values stay as they are."""

    num_replicas_in_sync = 1


_ALONE = _Alone()

# ``get_strategy`` (set by the strategy module, which imports this one): the default context's strategy.
_DEFAULT_STRATEGY: list[Callable[[], Any]] = []


def use_default_strategy(get_strategy: Callable[[], Any]) -> None:
    """Called once by `meshfit.distribute._strategy`: where the default context finds its strategy."""
    _DEFAULT_STRATEGY[:] = [get_strategy]


# The replica contexts entered (``strategy.run``, the seam `replica_context_scope`), innermost last.
class _PerThread(threading.local):
    """Each thread's own stack (TensorFlow's replica context is per thread: a data-prefetch or
    checkpoint-writer thread started during a step is not inside that step's replica context)."""

    def __init__(self) -> None:
        self.stack: list[ReplicaContext] = []


_THREAD = _PerThread()


def _stack() -> list[ReplicaContext]:
    return _THREAD.stack


class ReplicaContext:
    """This replica's view of its strategy, as ``tf.distribute.ReplicaContext``.

    Get it with `get_replica_context` inside ``strategy.run``; it is not built by hand.

    Args:
        strategy: the strategy running this replica.
        replica_id_in_sync_group: this replica's index among the replicas in sync.

    Example:
        >>> import torch, meshfit as mf
        >>> strategy = mf.OneDeviceStrategy("cpu")
        >>> def step():
        ...     context = mf.distribute.get_replica_context()
        ...     return context.all_reduce(mf.ReduceOp.SUM, torch.tensor(2.0)), context.num_replicas_in_sync
        >>> strategy.run(step)
        (tensor(2.), 1)
    """

    def __init__(self, strategy: Any, replica_id_in_sync_group: int, *, default: bool = False) -> None:
        # the default context (outside every strategy) finds its strategy when asked: get_strategy()
        # may form a global distribution's processes, which reading this context must not do
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group
        self._default = default

    @property
    def strategy(self) -> Any:
        """The strategy running this replica (the default context's: ``get_strategy()``'s)."""
        if self._strategy is None:
            return _DEFAULT_STRATEGY[0]()
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas combine their values in ``all_reduce`` (1 in the default context)."""
        return 1 if self._default else int(self.strategy.num_replicas_in_sync)

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's index, ``0 <= id < num_replicas_in_sync`` (the replica's coordinate along ``batch``)."""
        return self._replica_id

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: Any = None) -> Any:
        """Sum (``SUM``) or average (``MEAN``) ``value`` over the replicas; every replica gets the result.

        A collective: every replica calls it, with the same structure. Differentiable: the gradient
        that reaches ``value`` is the sum (or mean) of every replica's gradient of the result.

        Args:
            reduce_op: ``ReduceOp.SUM``/``MEAN`` or ``"SUM"``/``"MEAN"``.
            value: a tensor, a NumPy array, a number, or a dict/list/tuple of them.
            options: accepted for TensorFlow's signature; the strategy's communication options apply.

        Returns:
            ``value``'s structure with each leaf combined (tensors of the leaves' dtypes; an integer
            leaf's ``MEAN`` is a float tensor, as TensorFlow's).

        Raises:
            RuntimeError: the default replica context (outside ``strategy.run``) of a process in a
                multi-process job: its sum would be this worker's value alone.
        """
        op = as_reduce_op(reduce_op)
        self._refuse_default_in_a_job("all_reduce")
        return reduce_structure(_ALONE if self._default else self._strategy, op, value, "all_reduce")

    def all_gather(self, value: Any, axis: int, options: Any = None) -> Any:
        """Every replica's ``value`` concatenated along ``axis``, in replica order, on every replica.

        Sizes along ``axis`` may differ between replicas; shapes elsewhere, ranks and dtypes may not
        (refused on every replica with "Shape mismatch"). Differentiable, as TensorFlow's.

        Args:
            value: a tensor (rank 1 or more), or a dict/list/tuple of them.
            axis: the dimension to concatenate along.
            options: accepted for TensorFlow's signature.
        """
        self._refuse_default_in_a_job("all_gather")
        return gather_structure(_ALONE if self._default else self._strategy, value, axis, "all_gather")

    def merge_call(self, merge_fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        """Run ``merge_fn(strategy, *args, **kwargs)`` in the cross-replica context, as TensorFlow's.

        With several replicas, tensors in ``args``/``kwargs`` reach ``merge_fn`` as `PerReplica`
        values (combine them with ``strategy.reduce``).
        """
        strategy = self.strategy
        several = self.num_replicas_in_sync > 1
        args = tuple(regroup(a) for a in args) if several else tuple(args)
        kwargs = {k: regroup(v) for k, v in (kwargs or {}).items()} if several else dict(kwargs or {})
        with _cross_replica():
            return merge_fn(strategy, *args, **kwargs)

    def _refuse_default_in_a_job(self, method: str) -> None:
        if not self._default:
            return
        world = process_world()
        formed = World.process_group_shape()  # a group the user formed without a strategy counts too
        size = world.size if world is not None else (formed[1] if formed is not None else 1)
        if size > 1:
            raise RuntimeError(
                f"Invalid {method} in the default replica context: get_replica_context() was called outside "
                f"strategy.run, where it stands for this process alone, but this job has {size} processes; "
                f"the result would be this worker's value only. Call it inside strategy.run(fn) (there it "
                f"combines every replica's value), or outside it use strategy.reduce(op, value, axis=None) / "
                f"strategy.gather(value, axis).")

    def __repr__(self) -> str:
        kind = "default " if self._default else ""
        return f"<{kind}ReplicaContext replica {self._replica_id} of {self.num_replicas_in_sync}>"


def get_replica_context() -> ReplicaContext | None:
    """This replica's `ReplicaContext` inside ``strategy.run``; None in the cross-replica context (inside
    ``strategy.scope()``, outside ``run``); else the default replica context, as TensorFlow's.

    Example:
        >>> import meshfit as mf
        >>> mf.distribute.get_replica_context().num_replicas_in_sync  # outside every strategy
        1
        >>> with mf.OneDeviceStrategy("cpu").scope():
        ...     print(mf.distribute.get_replica_context())
        None
    """
    stack = _THREAD.stack
    if stack:
        return stack[-1]
    if current_scope_strategy() is not None:
        return None
    return ReplicaContext(None, 0, default=True)


def in_cross_replica_context() -> bool:
    """Whether we are inside a strategy's scope but outside ``strategy.run`` (TensorFlow's rule).

    Example:
        >>> import meshfit as mf
        >>> strategy = mf.OneDeviceStrategy("cpu")
        >>> with strategy.scope():
        ...     outside = mf.distribute.in_cross_replica_context()
        ...     inside = strategy.run(mf.distribute.in_cross_replica_context)
        >>> outside, inside
        (True, False)
    """
    return not _THREAD.stack and current_scope_strategy() is not None


def get_cross_replica_context() -> Any:
    """The strategy in the cross-replica context; the default strategy outside every scope; None inside
    ``strategy.run``, as TensorFlow's.

    Example:
        >>> import meshfit as mf
        >>> strategy = mf.OneDeviceStrategy("cpu")
        >>> with strategy.scope():
        ...     mf.distribute.get_cross_replica_context() is strategy
        True
    """
    if _THREAD.stack:
        return None
    return _DEFAULT_STRATEGY[0]()


def in_replica_context() -> bool:
    """Whether code runs as one replica (inside ``strategy.run`` or a step of ``fit``)."""
    return bool(_THREAD.stack)


class _ReplicaScope:
    """Enters one replica context (a plain class: ``fit`` enters it at every step, where a generator
    context manager costs several Python calls more)."""

    __slots__ = ("context",)

    def __init__(self, context: ReplicaContext) -> None:
        self.context = context

    def __enter__(self) -> ReplicaContext:
        _THREAD.stack.append(self.context)
        return self.context

    def __exit__(self, *exc: object) -> None:
        _THREAD.stack.pop()


_SCOPES: weakref.WeakKeyDictionary[Any, _ReplicaScope] = weakref.WeakKeyDictionary()  # one per strategy


def replica_context_scope(strategy: Any) -> _ReplicaScope:
    """Within: code runs as ``strategy``'s replica (``strategy.run`` enters it; so may a training loop).

    A strategy's replica id is fixed for its life: its scope is made once.
    """
    try:
        return _SCOPES[strategy]
    except (KeyError, TypeError):  # TypeError: a strategy that cannot be weakly referenced
        scope = _ReplicaScope(ReplicaContext(strategy, int(strategy.replica_id)))
        with contextlib.suppress(TypeError):
            _SCOPES[strategy] = scope
        return scope


@contextlib.contextmanager
def _cross_replica() -> Iterator[None]:
    """Within: no replica context (``merge_call``'s function runs in the cross-replica context)."""
    stack = _stack()
    saved = stack[:]
    stack.clear()
    try:
        yield
    finally:
        stack[:] = saved
