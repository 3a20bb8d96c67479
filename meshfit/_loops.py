"""The loops behind ``Model.fit``, ``evaluate`` and ``predict``: written once, for every strategy.

A strategy changes how a step runs (module wrapping, data split, reductions); nothing here
branches on which strategy it is.
"""

from __future__ import annotations

import signal
from typing import Any

import numpy as np
import torch

from meshfit._data_handler import DataHandler
from meshfit._model import unpack_batch
from meshfit.callbacks import CallbackList
from meshfit.data._structure import batch_size_of, map_structure
from meshfit.distribute._failure import FailureState


def resolve_verbose(verbose: Any, strategy: Any) -> int:
    """Keras's ``verbose``: ``"auto"`` is 1; workers other than the chief stay quiet."""
    if verbose == "auto":
        verbose = 1
    if verbose not in (0, 1, 2) or isinstance(verbose, bool):
        raise ValueError(f"Invalid `verbose`: expected 'auto', 0, 1 or 2, received verbose={verbose!r}.")
    return verbose if strategy.is_chief else 0


def _check_epochs(epochs: Any, initial_epoch: Any) -> None:
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"Invalid `epochs`: expected a non-negative int, received epochs={epochs!r}.")
    if isinstance(initial_epoch, bool) or not isinstance(initial_epoch, int) or initial_epoch < 0:
        raise ValueError(f"Invalid `initial_epoch`: expected an int >= 0, received initial_epoch={initial_epoch!r}.")


def sync_logs(model: Any, flags: list[float] | None = None) -> tuple[dict[str, float], list[float]]:
    """Metric results over all replicas (their additive states summed), and summed ``flags``."""
    metrics = model.metrics
    states = [m.state_tensors() for m in metrics]
    flags = list(flags or [])
    if model.strategy.num_replicas_in_sync > 1:
        parts = [t.reshape(-1).to(torch.float64) for group in states for t in group]
        flat = torch.cat([*parts, torch.tensor(flags, dtype=torch.float64)])
        model.strategy.all_reduce_sum(flat)
        offset, reduced = 0, []
        for group in states:
            tensors = []
            for t in group:
                tensors.append(flat[offset:offset + t.numel()].reshape(t.shape).to(t.dtype))
                offset += t.numel()
            reduced.append(tuple(tensors))
        states, flags = reduced, flat[offset:].tolist()
    logs = {}
    for metric, state in zip(metrics, states):
        if metric is model._loss_tracker and model.loss is None:
            continue
        logs[metric.name] = float(metric.result_from(state))
    return logs, flags


class _PreemptionWatch:
    """SIGTERM sets a flag; the loop shares it with every replica at the next step boundary."""

    def __init__(self, enabled: bool, failure: FailureState) -> None:
        self.requested = False
        self._failure = failure
        self._previous: Any = None
        if enabled:
            try:
                self._previous = signal.signal(signal.SIGTERM, self._on_signal)
            except ValueError:  # not the main thread: leave SIGTERM alone
                self._previous = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True
        # If a peer died and the launcher is stopping the group, a broken collective should end
        # this worker at once rather than wait for the heartbeat to name the peer.
        self._failure.terminating = True

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def run_fit(model: Any, *, x: Any, y: Any, batch_size: Any, epochs: Any, verbose: Any, callbacks: Any,
            validation_data: Any, shuffle: bool, sample_weight: Any, initial_epoch: int,
            steps_per_epoch: Any, validation_steps: Any, validation_batch_size: Any,
            validation_freq: int) -> Any:
    model._require_compiled("fit")
    _check_epochs(epochs, initial_epoch)
    strategy = model.strategy
    verbose = resolve_verbose(verbose, strategy)
    with strategy.guard():
        data = DataHandler(x, y, sample_weight, batch_size, steps_per_epoch, shuffle, strategy)
        model.build(unpack_batch(data.peek())[0])
        cbs = CallbackList(callbacks, add_history=True, add_progbar=verbose != 0, model=model,
                           verbose=verbose, epochs=epochs, steps=data.steps)
        loop = model.loop_state
        loop.epoch, loop.step = initial_epoch, 0
        model.stop_training = False
        preemption = _PreemptionWatch(any(getattr(c, "handles_preemption", False) for c in cbs), strategy.failure)
        model.fit_context = {"data": data, "callbacks": cbs, "loop": loop}
        logs: dict[str, float] = {}
        epoch_logs: dict[str, float] = {}
        try:
            model.reset_metrics()
            cbs.on_train_begin()
            while loop.epoch < epochs and not model.stop_training:
                epoch = loop.epoch
                if loop.step == 0:
                    model.reset_metrics()
                cbs.on_epoch_begin(epoch)
                model.module.train()
                while loop.step < data.steps:
                    step = loop.step
                    cbs.on_train_batch_begin(step)
                    strategy.check_alive()
                    batch, global_size = data.next_batch()
                    with strategy.batch_weight(batch_size_of(batch), global_size):
                        returned = model.train_step(strategy.distribute_batch(batch))
                    loop.step += 1
                    loop.iterations += 1
                    strategy.failure.step = loop.iterations
                    logs, (preempt, stop) = sync_logs(model, [float(preemption.requested),
                                                              float(model.stop_training)])
                    logs.update(_as_logs(returned))
                    stop_agreed = stop > 0
                    model.stop_training = stop_agreed
                    cbs.on_train_batch_end(step, logs)
                    if preempt > 0:
                        _stop_for_preemption(model, cbs)
                    # A stop asked for in on_train_batch_end reaches the other replicas with the next
                    # step's all-reduce; stopping on it alone here would leave them waiting.
                    if stop_agreed or (model.stop_training and strategy.num_replicas_in_sync == 1):
                        break
                # The epoch's metrics from their (possibly restored) accumulators, on every replica.
                epoch_logs, _ = sync_logs(model)
                epoch_logs.update({k: v for k, v in logs.items() if k not in epoch_logs})
                if validation_data is not None and (epoch + 1) % validation_freq == 0:
                    val_x, val_y, val_w = _unpack_validation(validation_data)
                    val_logs = run_evaluate(model, x=val_x, y=val_y, sample_weight=val_w,
                                            batch_size=validation_batch_size or batch_size, verbose=0,
                                            steps=validation_steps, callbacks=None)
                    epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
                data.end_epoch()
                loop.epoch, loop.step = epoch + 1, 0
                cbs.on_epoch_end(epoch, epoch_logs)
                model.stop_training = _agree(strategy, model.stop_training)
            cbs.on_train_end(epoch_logs or logs)
            strategy.barrier()
        finally:
            preemption.close()
            data.close()
            model.fit_context = {}
    model.history = cbs.history
    return cbs.history


def _as_logs(returned: Any) -> dict[str, Any]:
    """What a Keras-style ``train_step`` override returned, as log values."""
    if not isinstance(returned, dict):
        return {}
    return {k: float(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v for k, v in returned.items()}


def _agree(strategy: Any, flag: bool) -> bool:
    """True on every replica when it is true on any (e.g. a chief-only callback stopped training)."""
    if strategy.num_replicas_in_sync == 1:
        return flag
    return bool(strategy.all_reduce_sum(torch.tensor([float(flag)], dtype=torch.float64)).item() > 0)


def _stop_for_preemption(model: Any, cbs: Any) -> None:
    """Every replica reached the same step: save a backup there and exit with the restart code."""
    from meshfit._exit_codes import PREEMPTED_EXIT_CODE

    for callback in cbs:
        if getattr(callback, "handles_preemption", False):
            callback.save_for_preemption()
    model.strategy.barrier()
    raise SystemExit(PREEMPTED_EXIT_CODE)


def _unpack_validation(validation_data: Any) -> tuple[Any, Any, Any]:
    if isinstance(validation_data, tuple):
        if len(validation_data) == 2:
            return validation_data[0], validation_data[1], None
        if len(validation_data) == 3:
            return validation_data
        raise ValueError("Invalid `validation_data`: expected a dataset, (x, y) or (x, y, sample_weight); "
                         f"received a tuple of {len(validation_data)} elements.")
    return validation_data, None, None


def _inference_setup(model: Any, x: Any, y: Any, sample_weight: Any, batch_size: Any, steps: Any,
                     verbose: Any, callbacks: Any) -> tuple[DataHandler, Any]:
    """The data and callbacks of one evaluate/predict pass (the model is built from the first batch)."""
    data = DataHandler(x, y, sample_weight, batch_size, steps, False, model.strategy, argument="steps")
    model.build(unpack_batch(data.peek())[0])
    verbose = resolve_verbose(verbose, model.strategy)
    cbs = CallbackList(callbacks, add_progbar=verbose != 0, model=model, verbose=verbose, epochs=1,
                       steps=data.steps)
    return data, cbs


def run_evaluate(model: Any, *, x: Any, y: Any, batch_size: Any, verbose: Any, sample_weight: Any,
                 steps: Any, callbacks: Any) -> dict[str, float]:
    model._require_compiled("evaluate")
    strategy = model.strategy
    resolve_verbose(verbose, strategy)  # a bad value fails before any data is read
    with strategy.guard():
        data, cbs = _inference_setup(model, x, y, sample_weight, batch_size, steps, verbose, callbacks)
        was_training = model.module.training
        model.reset_metrics()
        cbs.on_test_begin()
        logs: dict[str, float] = {}
        try:
            model.module.eval()
            with torch.no_grad():
                for step in range(data.steps):
                    cbs.on_test_batch_begin(step)
                    strategy.check_alive()
                    batch, _ = data.next_batch()
                    if batch_size_of(batch):
                        model.test_step(strategy.distribute_batch(batch))
                    logs, _ = sync_logs(model)
                    cbs.on_test_batch_end(step, logs)
        finally:
            model.module.train(was_training)
            data.close()
        cbs.on_test_end(logs)
    return logs


def run_predict(model: Any, *, x: Any, batch_size: Any, verbose: Any, steps: Any, callbacks: Any) -> Any:
    strategy = model.strategy
    resolve_verbose(verbose, strategy)
    with strategy.guard():
        data, cbs = _inference_setup(model, x, None, None, batch_size, steps, verbose, callbacks)
        was_training = model.module.training
        outputs: list[Any] = []
        cbs.on_predict_begin()
        try:
            model.module.eval()
            with torch.no_grad():
                for step in range(data.steps):
                    cbs.on_predict_batch_begin(step)
                    strategy.check_alive()
                    batch, _ = data.next_batch()
                    out = model.predict_step(strategy.distribute_batch(batch))
                    outputs.append(map_structure(lambda t: t.detach().cpu().numpy(), out))
                    cbs.on_predict_batch_end(step, {"outputs": out})
        finally:
            model.module.train(was_training)
            data.close()
        cbs.on_predict_end()
        if strategy.num_replicas_in_sync > 1 and getattr(data.source, "replicas_read_different_rows", True):
            by_replica = strategy.all_gather_object(outputs)
            outputs = [part for step in range(len(outputs)) for part in (r[step] for r in by_replica)]
    return _concatenate(outputs)


def _concatenate(outputs: list[Any]) -> Any:
    if not outputs:
        return np.zeros((0,))
    first = outputs[0]
    if isinstance(first, dict):
        return {k: _concatenate([o[k] for o in outputs]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(_concatenate([o[i] for o in outputs]) for i in range(len(first)))
    return np.concatenate(outputs, axis=0)
