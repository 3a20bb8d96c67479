"""Logs of a step: the metrics' additive states summed over the data-parallel axis, plus agreed flags.

Two planes: the metric states stay on the model's device and are summed by the device backend, only
when logs are read (the flags then ride in the same all-reduce: one collective a step); without a log
reader the flags (stop, preemption) are CPU numbers summed over the control plane (gloo), so such a
step queues its device work and returns without waiting for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch

from meshfit._protocols import DistributionStrategy, MetricLike, Trainable


def reduce_logs(trainable: Trainable, flags: Sequence[float] = (), *,
                with_metrics: bool = True) -> tuple[dict[str, float], list[float]]:
    """Metric results over all replicas and the replicas' summed ``flags``.

    Args:
        trainable: whose ``logged_metrics()`` to read.
        flags: small numbers every replica must agree on (a stop or preemption request).
        with_metrics: False skips the metrics (no reduction of their states, no host sync of their
            results): the loop does that when no callback reads per-batch logs.

    Returns:
        ``(logs, flags)``: ``{name: value}`` (empty without metrics) and the flags over every process:
        each is positive where any process's is (summed over every process, also along a mesh's
        other axes).
    """
    strategy = trainable.strategy
    if not with_metrics:  # the loop's usual step: the flags alone
        return {}, sum_flags(strategy, flags)
    metrics: Sequence[MetricLike] = trainable.logged_metrics()
    states = [m.state_tensors() for m in metrics]
    # Every process takes part, also along a mesh's ``model`` axis: a stop or preemption flag raised
    # on any process must reach all of them.
    if strategy.num_processes > 1 and any(states):
        # The flags ride in the metrics' all-reduce (logs read: the host waits for it anyway), instead
        # of a second collective on the control plane; each comes back positive where any process's was.
        states, summed = _sum_states(trainable, strategy, states, flags)
    else:
        summed = sum_flags(strategy, flags)
    logs = {metric.name: float(metric.result_from(state)) for metric, state in zip(metrics, states, strict=True)}
    return logs, summed


def _sum_states(trainable: Trainable, strategy: DistributionStrategy, states: list[tuple[torch.Tensor, ...]],
                flags: Sequence[float]) -> tuple[list[tuple[torch.Tensor, ...]], list[float]]:
    """The metric states summed over replicas and the flags over every process, in one all-reduce
    on the device backend (`DistributionStrategy.all_reduce_states`)."""
    parts = [t.reshape(-1).to(strategy.device, torch.float64) for group in states for t in group]
    if flags:
        parts.append(torch.tensor([float(f) for f in flags], dtype=torch.float64, device=strategy.device))
    flat = torch.cat(parts)
    strategy.all_reduce_states(flat, flags=len(flags), lead=trainable.residency.leads_logs)
    offset, reduced = 0, []
    for group in states:
        tensors = []
        for t in group:
            tensors.append(flat[offset:offset + t.numel()].reshape(t.shape).to(t.dtype))
            offset += t.numel()
        reduced.append(tuple(tensors))
    return reduced, (flat[offset:].tolist() if flags else [])


def sum_flags(strategy: DistributionStrategy, flags: Sequence[float]) -> list[float]:
    """``flags`` summed over every process on the control plane: a CPU tensor over gloo, never a
    device tensor (reading it back is no device sync)."""
    values = [float(f) for f in flags]
    if strategy.num_processes <= 1 or not values:
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    strategy.all_reduce_control(tensor)
    return tensor.tolist()


def as_logs(returned: Any, *, convert: bool = True) -> dict[str, Any]:
    """What a Keras-style ``train_step`` override returned, as log values.

    With ``convert=False`` one-element tensors stay tensors (no host sync): the loop converts them
    when logs are read (`as_logs` again).
    """
    if not isinstance(returned, Mapping):
        return {}
    if not convert:
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in returned.items()}
    return {k: float(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v for k, v in returned.items()}


class MetricResults(MutableMapping[str, Any]):
    """``{name: metric.result()}``, each result computed when read (a step returns it at no cost).

    What the built-in steps return to the loop (and to an override calling ``super().train_step``).
    Mutable as the dict Keras's steps return: an override may add, replace or delete entries
    (``logs = super().train_step(data); logs["my_value"] = ...``). The loop logs the metrics it reduces
    over replicas, less those deleted, with what the override set (see `merge_returned`): the dict Keras
    would log, with the metrics' values of all replicas.
    """

    def __init__(self, metrics: Sequence[MetricLike] | Callable[[], Sequence[MetricLike]]) -> None:
        self._source = metrics  # a callable (the model's ``logged_metrics``) is called when first read
        self._by_name: dict[str, MetricLike] | None = None
        self._entries: dict[str, Any] = {}  # what an override set: logged as it is
        self._deleted: set[str] = set()  # metrics an override deleted: not logged

    @property
    def _metrics(self) -> dict[str, MetricLike]:
        """The metrics by name, listed when first needed: a step's return value that nobody reads
        (``fit`` without a reader of batch logs) costs no walk over the model's metrics."""
        if self._by_name is None:
            metrics = self._source() if callable(self._source) else self._source
            self._by_name = {m.name: m for m in metrics}
        return self._by_name

    def __getitem__(self, name: str) -> Any:
        if name in self._entries:
            return self._entries[name]
        if name in self._deleted:
            raise KeyError(name)
        return self._metrics[name].result()

    def __setitem__(self, name: str, value: Any) -> None:
        self._entries[name] = value
        self._deleted.discard(name)

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)
        self._entries.pop(name, None)
        if name in self._metrics:
            self._deleted.add(name)

    def __iter__(self) -> Any:
        listed = [k for k in self._metrics if k not in self._deleted or k in self._entries]
        return iter([*listed, *(k for k in self._entries if k not in self._metrics)])

    def __len__(self) -> int:
        return len(list(iter(self)))

    def __repr__(self) -> str:
        return repr(dict(self))

    def entries(self) -> dict[str, Any]:
        """What an override set or replaced (the remaining metrics are read from the metrics)."""
        return dict(self._entries)

    def deleted(self) -> set[str]:
        """The metrics an override deleted (and did not set again)."""
        return set(self._deleted)


def may_own_logs(returned: Any) -> bool:
    """False where a step's return value holds no logs of its own: None, or
    ``super().train_step``'s `MetricResults` with nothing set; checked without listing the metrics."""
    return returned is not None and (type(returned) is not MetricResults or bool(returned._entries)
                                     or bool(returned._deleted))


def replaces_metrics(trainable: Trainable, returned: Any) -> bool:
    """Whether a step's return value is a dict of an override's own, with other names than the logged
    metrics': then it is the step's logs alone, and the last step's are the epoch's (Keras's
    ``_get_metrics_result_or_logs``), not the metrics' results (which such a step may never update)."""
    return (returned is not None and not isinstance(returned, MetricResults) and isinstance(returned, Mapping)
            and set(returned) != {m.name for m in trainable.logged_metrics()})


def mean_over_processes(strategy: DistributionStrategy, logs: dict[str, Any]) -> dict[str, Any]:
    """``logs`` with each number replaced by its mean over every process (one sum on the control plane), so
    that every process's callbacks see one value (a saver deciding on one of them decides for all); other
    values stay as they are. Every process must call it with the same names."""
    names = sorted(k for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    if strategy.num_processes <= 1 or not names:
        return logs
    summed = sum_flags(strategy, [float(logs[name]) for name in names])
    return {**logs, **{name: total / strategy.num_processes for name, total in zip(names, summed, strict=True)}}


def merge_returned(trainable: Trainable, logs: dict[str, Any], returned: Any, *,
                   convert: bool = True) -> dict[str, Any]:
    """Put what a step returned in ``logs`` (the metrics' results), as Keras does (``_get_metrics_result_or_logs``).

    A dict with exactly the logged metrics' names (what ``compute_metrics`` returns) is read from the
    metrics, reduced over replicas: ``logs`` as they are. What an override set in ``super().train_step``'s
    results (`MetricResults`) is logged as it set it, and the metrics it deleted are not.
    A dict of the override's own (`replaces_metrics`) replaces them: the logs are that dict alone. Tensors
    are left unread with ``convert=False``.
    """
    if replaces_metrics(trainable, returned):
        logs.clear()
        logs.update(as_logs(returned, convert=convert))
    elif isinstance(returned, MetricResults):
        for name in returned.deleted():
            logs.pop(name, None)
        logs.update(as_logs(returned.entries(), convert=convert))
    return logs


def agree(trainable: Trainable, flag: bool) -> bool:
    """True on every replica when it is true on any (e.g. a chief-only callback stopped training)."""
    return sum_flags(trainable.strategy, [float(flag)])[0] > 0


class LazyLogs(MutableMapping[str, Any]):
    """One process's batch logs, reduced when first read: `reduce_logs` and `merge_returned` of the
    step that made them. The loop hands them to a progress bar, which reads them only at the steps it
    redraws; read later than the hook it was given to, it would show a later step's values, so the
    loop uses it only where every callback with a batch-end hook is a progress bar (it reads at once or
    never) and where the epoch's end reads the last step's at once."""

    def __init__(self, trainable: Trainable, returned: Any) -> None:
        self._trainable, self._returned = trainable, returned
        self._logs: dict[str, Any] | None = None

    def _read(self) -> dict[str, Any]:
        if self._logs is None:
            logs, _ = reduce_logs(self._trainable)
            self._logs = merge_returned(self._trainable, logs, self._returned)
        return self._logs

    def __getitem__(self, name: str) -> Any:
        return self._read()[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self._read()[name] = value

    def __delitem__(self, name: str) -> None:
        del self._read()[name]

    def __iter__(self) -> Any:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())

    def __repr__(self) -> str:
        return repr(self._read())
