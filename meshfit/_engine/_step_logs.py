"""Logs of a step: the metrics' additive states summed over the data-parallel axis, plus agreed flags."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from meshfit._protocols import MetricLike, Trainable


def reduce_logs(trainable: Trainable, flags: Sequence[float] = (), *,
                with_metrics: bool = True) -> tuple[dict[str, float], list[float]]:
    """Metric results over all replicas and the replicas' summed ``flags``, in one all-reduce.

    Args:
        trainable: whose ``logged_metrics()`` to read.
        flags: small numbers every replica must agree on (a stop or preemption request).
        with_metrics: False skips the metrics (no reduction of their states, no host sync of their
            results): the loop does that when no callback reads per-batch logs.

    Returns:
        ``(logs, flags)``: ``{name: value}`` (empty without metrics) and the summed flags.
    """
    metrics: list[MetricLike] = trainable.logged_metrics() if with_metrics else []
    states = [m.state_tensors() for m in metrics]
    flags = [float(f) for f in flags]
    strategy = trainable.strategy
    # Every process takes part, also along a mesh's ``model`` axis: a stop or preemption flag raised
    # on any process must reach all of them.
    if strategy.num_processes > 1 and (states or flags):
        parts = [t.reshape(-1).to(torch.float64) for group in states for t in group]
        flat = torch.cat([*parts, torch.tensor(flags, dtype=torch.float64)])
        strategy.all_reduce_sum(flat)
        offset, reduced = 0, []
        for group in states:
            tensors = []
            for t in group:
                tensors.append(flat[offset:offset + t.numel()].reshape(t.shape).to(t.dtype))
                offset += t.numel()
            reduced.append(tuple(tensors))
        states, flags = reduced, flat[offset:].tolist()
    logs = {metric.name: float(metric.result_from(state)) for metric, state in zip(metrics, states, strict=True)}
    return logs, flags


def as_logs(returned: Any) -> dict[str, Any]:
    """What a Keras-style ``train_step`` override returned, as log values."""
    if not isinstance(returned, Mapping):
        return {}
    return {k: float(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v for k, v in returned.items()}


class MetricResults(Mapping):
    """``{name: metric.result()}``, each result computed when read (a step returns it at no cost)."""

    def __init__(self, metrics: Sequence[MetricLike]) -> None:
        self._metrics = {m.name: m for m in metrics}

    def __getitem__(self, name: str) -> Any:
        return self._metrics[name].result()

    def __iter__(self) -> Any:
        return iter(self._metrics)

    def __len__(self) -> int:
        return len(self._metrics)

    def __repr__(self) -> str:
        return repr(dict(self))


def merge_returned(trainable: Trainable, logs: dict[str, Any], returned: Any) -> dict[str, Any]:
    """Add what a step returned to ``logs``, as Keras does (``_get_metrics_result_or_logs``).

    A dict with exactly the logged metrics' names (what ``super().train_step`` and
    ``compute_metrics`` return) is read from the metrics, reduced over replicas; anything else a
    Keras-style override returned is logged as it is.
    """
    if isinstance(returned, Mapping) and set(returned) != {m.name for m in trainable.logged_metrics()}:
        logs.update(as_logs(returned))
    return logs


def agree(trainable: Trainable, flag: bool) -> bool:
    """True on every replica when it is true on any (e.g. a chief-only callback stopped training)."""
    return reduce_logs(trainable, [float(flag)], with_metrics=False)[1][0] > 0
