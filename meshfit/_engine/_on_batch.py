"""Keras's ``train_on_batch``, ``test_on_batch`` and ``predict_on_batch`` on a `Model`.

Each runs the steps ``fit``, ``evaluate`` and ``predict`` run, on one batch: under a strategy the
batch is the global one, split across the replicas as ``fit`` splits a batch of arrays, and the logs
are reduced over them. As in Keras 3, each call reports that batch alone (the metrics start afresh).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from meshfit._engine._data_handler import DataHandler, _is_array_like
from meshfit._engine._executions import next_batch
from meshfit._engine._fit_arguments import ClassWeightedData, check_class_weight, check_loss_reduction
from meshfit._engine._loop import run_train_step
from meshfit._engine._step_logs import merge_returned, reduce_logs
from meshfit._protocols import DistributionStrategy
from meshfit._runtime import flush_denormals
from meshfit._validation import check_bool
from meshfit.data import leaves, unpack_batch
from meshfit.distribute import agree_buffers, check_training_strategy


def _batch_length(x: Any) -> int:
    """The number of examples in the batch ``x`` (arrays or tensors, or a dict / list of them)."""
    if not _is_array_like(x):
        raise ValueError(f"Invalid `x`: expected one batch of arrays or tensors (or a dict / list of them), as "
                         f"Keras's *_on_batch methods take, received x of type {type(x).__name__}. Pass a "
                         "dataset to fit / evaluate / predict instead.")
    return len(leaves(x)[0])


class OnBatchMixin:
    """The ``*_on_batch`` side of `meshfit.Model` (needs its strategy, build, steps and evaluate/predict)."""

    strategy: DistributionStrategy
    loss: Any
    _require_compiled: Callable[[str], None]
    build: Callable[[Any], None]
    reset_metrics: Callable[[], None]
    evaluate: Callable[..., Any]
    predict: Callable[..., Any]

    def train_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None,
                       class_weight: dict[int, float] | None = None, return_dict: bool = False) -> Any:
        """One optimisation step on the batch ``(x, y)``; its loss and metrics (Keras's arguments).

        Returns:
            The logs as a dict with ``return_dict=True``; else a list in ``metrics_names``' order (a
            single number when there is one).
        """
        check_bool("return_dict", return_dict)
        self._require_compiled("train_on_batch")
        check_training_strategy(self, "train_on_batch")
        check_loss_reduction(self.loss, self.strategy.num_replicas_in_sync)
        table = check_class_weight(class_weight, sample_weight)
        with self.strategy.guard(), flush_denormals():
            data: Any = DataHandler(x, y, sample_weight, _batch_length(x), 1, False, self.strategy,
                                    argument="steps")
            if table is not None:
                data = ClassWeightedData(data, table)
            try:
                self.build(unpack_batch(data.peek())[0])
                self.reset_metrics()
                data.start_epoch()
                fetched = next_batch(self, data)  # type: ignore[arg-type]
                if fetched is None:
                    raise ValueError("Invalid `x`: the batch is empty.")
                self.module.train()  # type: ignore[attr-defined]
                returned = run_train_step(self, *fetched)  # type: ignore[arg-type]
                logs, _ = reduce_logs(self)  # type: ignore[arg-type]
                merge_returned(self, logs, returned)  # type: ignore[arg-type]
                if self.strategy.num_replicas_in_sync > 1:  # as fit ends an epoch: one set of buffers
                    agree_buffers(self.module, self.strategy, self.residency)  # type: ignore[attr-defined]
            finally:
                data.close()
        return self._as_result(logs, return_dict)

    def test_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None, return_dict: bool = False) -> Any:
        """The loss and metrics of the batch ``(x, y)``, no update (Keras's arguments and return values)."""
        check_bool("return_dict", return_dict)
        self._require_compiled("test_on_batch")
        logs = self.evaluate(x, y, batch_size=_batch_length(x), verbose=0, sample_weight=sample_weight,
                             return_dict=True)
        return self._as_result(logs, return_dict)

    def predict_on_batch(self, x: Any) -> Any:
        """The model's outputs for the batch ``x``, as numpy arrays in the outputs' structure."""
        return self.predict(x, batch_size=_batch_length(x), verbose=0)

    def _as_result(self, logs: Mapping[str, Any], return_dict: bool) -> Any:
        if return_dict:
            return dict(logs)
        names = [name for name in self.metrics_names if name in logs]  # type: ignore[attr-defined]
        values = [logs[name] for name in names] + [logs[key] for key in sorted(logs) if key not in names]
        return values[0] if len(values) == 1 else values
