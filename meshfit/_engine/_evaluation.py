"""The evaluation and prediction loops over a `Trainable`: written once, for every strategy."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from meshfit._engine._executions import next_batch, steps_per_execution
from meshfit._engine._outputs import host_outputs
from meshfit._engine._step_logs import (
    agree,
    as_logs,
    merge_returned,
    reduce_logs,
    replaces_metrics,
    sum_flags,
)
from meshfit._engine._steps import StepsMixin
from meshfit._protocols import CallbackListLike, Trainable
from meshfit._saving import require_every_worker, split_across_workers
from meshfit.callbacks import implements_hook
from meshfit.data import batch_size_of
from meshfit.distribute import DistributedDataset, LoaderPlan, OneDeviceStrategy, replica_context_scope


@contextlib.contextmanager
def where_to_run(model: Any, call: str, x: Any, inside_fit: bool) -> Iterator[None]:
    """Run an ``evaluate``/``predict`` outside ``fit`` on this worker alone when it can be.

    A replicated model (every worker holds every weight) given the whole data (arrays, a Dataset, a
    DataLoader without a ``DistributedSampler``) is evaluated here, on all the data, with no
    collective: ``if task_id == 0: model.evaluate(...)`` works, and every worker calling it gets the
    same numbers. Sharded weights, or data that gives each worker its part, need every worker: the
    call checks that the others came (`require_every_worker`) and runs across them, as in ``fit``.
    """
    strategy = model.strategy
    if inside_fit or strategy.num_processes <= 1:
        yield
        return
    if split_across_workers(model) or isinstance(x, DistributedDataset) or LoaderPlan.reads_own_shard(x):
        why = ("the model's weights are split across the workers (mf.dtensor layouts)" if split_across_workers(model)
               else "the data gives each worker its own part (a distributed dataset or a DistributedSampler)")
        with strategy.guard():
            require_every_worker(strategy, f"model.{call}", why)
        yield
        return
    placement = model.placement
    model.strategy = OneDeviceStrategy(strategy.device)  # this worker alone, on all of the data
    try:
        yield
    finally:
        model.strategy = strategy
        if placement is None:  # built here for this call: fit places the module with its own strategy
            model.placement = None


def evaluate(trainable: Trainable, data: Any, callbacks: Any) -> dict[str, float]:
    """Loss and metrics over ``data`` (this replica's batches), reduced over all replicas.

    As Keras's ``evaluate``: a ``test_step`` override that returns a dict of its own (other names
    than the logged metrics') makes that dict the result.
    """
    module = trainable.module
    was_training = module.training
    trainable.reset_metrics()
    trainable.stop_evaluating = False
    callbacks.on_test_begin()
    logs: dict[str, float] = {}
    returned: Any = None
    readers, stop = _test_loop_needs(trainable, callbacks)
    try:
        module.eval()
        with torch.no_grad():
            # a placement whose ranks hold different parts (a pipeline's stages) steps together: every rank
            # takes every batch, an empty share too (its step joins the others' collectives)
            together = not trainable.residency.everywhere
            for returned in _executions(trainable, data, callbacks.on_test_batch_begin, trainable.test_step,
                                        empty_ok=together, stops=stop):
                if readers:  # Keras's rule: the metrics are reduced at each step only for a reader of the logs
                    logs, summed = reduce_logs(trainable, stop.riding() if stop is not None else [])
                    if stop is not None:
                        stop.arrived(summed)
                    merge_returned(trainable, logs, returned[1])
                callbacks.on_test_batch_end(returned[0], logs)
        if returned is not None and not readers:  # once, after the last step: the same values
            logs, _ = reduce_logs(trainable)
            merge_returned(trainable, logs, returned[1])
    finally:
        module.train(was_training)
    if returned is not None and replaces_metrics(trainable, returned[1]):
        logs = as_logs(returned[1])  # a dict of the override's own is the result (Keras)
    callbacks.on_test_end(logs)
    return logs


def _test_loop_needs(trainable: Trainable, callbacks: Any) -> tuple[bool, StopFlag | None]:
    """Whether a callback reads ``on_test_batch_end``'s logs, and what tells the loop that something set
    ``stop_evaluating`` (None where nothing may)."""
    if trainable.strategy.num_processes <= 1:
        return _reads_test_logs(callbacks), StopFlag(trainable, "stop_evaluating", False)
    reads, may_stop = sum_flags(trainable.strategy, [float(_reads_test_logs(callbacks)),
                                                     float(_may_stop(trainable, callbacks, "test"))])
    return reads > 0, StopFlag(trainable, "stop_evaluating", reads > 0) if may_stop > 0 else None


class StopFlag:
    """Keras 3's ``stop_evaluating`` / ``stop_predicting`` as a loop reads it after each execution: the
    attribute, on one process. On several, every process must end at the same step: the flag is summed
    over them, in the next step's reduction of the logs where a callback reads them (no collective of its
    own: the loop then ends one step later, as with a training batch hook's stop), else after each
    execution on its own."""

    def __init__(self, trainable: Trainable, attribute: str, rides_with_logs: bool) -> None:
        self.trainable, self.attribute = trainable, attribute
        self.several = trainable.strategy.num_processes > 1
        self.rides = self.several and rides_with_logs
        self._agreed = False

    def riding(self) -> list[float]:
        """The flag to add to a log reduction (nothing where it does not ride there)."""
        return [float(bool(getattr(self.trainable, self.attribute)))] if self.rides else []

    def arrived(self, summed: list[float]) -> None:
        """The flags a log reduction summed (`riding`'s)."""
        if self.rides:
            self._agreed = summed[0] > 0

    def __call__(self) -> bool:
        raised = bool(getattr(self.trainable, self.attribute))
        if not self.several:
            return raised
        return self._agreed if self.rides else agree(self.trainable, raised)


def _may_stop(trainable: Trainable, callbacks: Any, kind: str) -> bool:
    """Whether something may set ``stop_evaluating`` / ``stop_predicting`` during the loop: a callback with
    a batch hook, a step override, or callbacks that cannot be listed (the Estimator's hooks)."""
    step = getattr(getattr(trainable, f"{kind}_step", None), "__func__", None)
    if step is not getattr(StepsMixin, f"{kind}_step"):
        return True
    try:
        listed = list(callbacks)
    except TypeError:
        return True
    return any((implements_hook(c, f"on_{kind}_batch_end") or implements_hook(c, f"on_{kind}_batch_begin"))
               and getattr(c, "stops_in_batch_hooks", True) for c in listed)


def _reads_test_logs(callbacks: Any) -> bool:
    """Whether a callback reads ``on_test_batch_end``'s logs: it implements the hook and does not say
    otherwise (``reads_test_batch_logs``, e.g. `ProgbarLogger` inside ``fit``). Callbacks that cannot be
    listed (the Estimator's hooks) are taken to read them."""
    try:
        listed = list(callbacks)
    except TypeError:
        return True
    return any(implements_hook(c, "on_test_batch_end") and getattr(c, "reads_test_batch_logs", True) for c in listed)


def _executions(trainable: Trainable, data: Any, on_begin: Callable[[int], None], step_fn: Callable[[Any], Any],
                empty_ok: bool, stops: Callable[[], bool] | None = None) -> Iterator[tuple[int, Any]]:
    """Run ``step_fn`` over ``data`` in executions of ``steps_per_execution`` steps (Keras 3's
    indices); yields ``(nominal end index, what the execution's last step returned)`` per execution, and
    ends after the execution whose hooks (run by the caller between two yields) made ``stops()`` true:
    Keras's ``stop_evaluating`` / ``stop_predicting``."""
    strategy, n, step = trainable.strategy, steps_per_execution(trainable), 0
    while (count := data.execution_size(step, n)) > 0:
        strategy.check_alive()
        fetched = next_batch(trainable, data)
        if fetched is None:
            break
        begin, returned = step, None
        on_begin(begin)
        for done in range(count):
            if done:
                strategy.check_alive()
                fetched = next_batch(trainable, data)
                if fetched is None:
                    break
            batch = fetched[0]
            if empty_ok or batch_size_of(batch):
                with replica_context_scope(strategy):  # as TF Keras runs each step in `strategy.run`
                    returned = step_fn(strategy.distribute_batch(batch))
            step += 1
        yield begin + n - 1, returned
        if fetched is None or (stops is not None and stops()):
            break


def predict(trainable: Trainable, data: Any, callbacks: CallbackListLike | Any) -> Any:
    """The outputs for all of ``data``, in input order, on every replica (numpy)."""
    strategy = trainable.strategy
    module = trainable.module
    was_training = module.training
    outputs: list[Any] = []

    def step_fn(batch: Any) -> Any:
        out = trainable.predict_step(batch)
        outputs.append(host_outputs(out))
        return out

    trainable.stop_predicting = False
    stops = StopFlag(trainable, "stop_predicting", False) if strategy.num_processes <= 1 \
        or agree(trainable, _may_stop(trainable, callbacks, "predict")) else None
    callbacks.on_predict_begin()
    try:
        module.eval()
        with torch.no_grad():
            for end, out in _executions(trainable, data, callbacks.on_predict_batch_begin, step_fn, empty_ok=True,
                                        stops=stops):
                callbacks.on_predict_batch_end(end, {"outputs": out})
    finally:
        module.train(was_training)
    callbacks.on_predict_end()
    if strategy.num_replicas_in_sync > 1 and data.source.replicas_read_different_rows:
        by_replica = strategy.all_gather_object(outputs)
        outputs = [part for step in range(len(outputs)) for part in (r[step] for r in by_replica)]
    return concatenate(outputs)


def concatenate(outputs: list[Any]) -> Any:
    """Per-batch outputs (arrays, or tuples/dicts of them) joined along the batch dimension."""
    if not outputs:
        return np.zeros((0,))
    first = outputs[0]
    if first is None:  # an output that holds no tensor (a cache object)
        return None
    if isinstance(first, dict):
        return {k: concatenate([o[k] for o in outputs]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(concatenate([o[i] for o in outputs]) for i in range(len(first)))
    return np.concatenate(outputs, axis=0)
