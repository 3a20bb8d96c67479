"""What a step of ``fit`` on 2 workers shares besides the gradients: nothing, where nothing can ask to stop
inside an epoch (no callback with a training batch hook, no preemption handler, the built-in
``train_step``). A stop asked for before an epoch's first step, or inside a ``train_step`` override,
still stops every worker at the same step as before; one asked for elsewhere on one worker is agreed at
the epoch's end. A validation step reduces the metrics only for a reader of its batch logs. Real processes,
gloo; gradients travel inside DDP's reducer and are not counted (`tests/_collectives.py`)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from _collectives import count_collectives
from _multiproc import run_distributed
from torch import nn

import meshfit as mf

BATCH = 8  # global: 4 rows a worker


def _model(strategy: mf.MultiWorkerMirroredStrategy, model_class: type[mf.Model] = mf.Model) -> mf.Model:
    with strategy.scope():
        torch.manual_seed(0)
        model = model_class(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
        model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    return model


def _data(steps: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(steps * BATCH, 4)).astype("float32"), rng.integers(0, 3, size=steps * BATCH)


class _EpochsOnly(mf.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        pass


def _marginal_collectives(rank: int, size: int) -> dict[str, float]:
    """Collectives a further step costs in one fit of one epoch: a 16-step fit minus an 8-step one."""
    strategy = mf.MultiWorkerMirroredStrategy()
    counts = count_collectives()
    figures = {}
    for name, callbacks in (("plain", []), ("epoch_hooks_only", [_EpochsOnly()]),
                            ("batch_hook", [mf.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: None)])):
        model = _model(strategy)
        per_fit = []
        for steps in (8, 16, 8, 16):  # the first pair warms DDP up (its first steps set up)
            x, y = _data(steps)
            before = counts[0]
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
            per_fit.append(counts[0] - before)
        figures[name] = (per_fit[3] - per_fit[2]) / 8
    return figures


def test_a_step_without_anything_that_can_stop_makes_no_control_collective():
    for figures in run_distributed(_marginal_collectives, world_size=2, timeout=240):
        # Before: one reduction of the stop / preemption flags at every step (1.0 each).
        assert figures["plain"] == 0.0, figures
        assert figures["epoch_hooks_only"] == 0.0, figures
        assert figures["batch_hook"] == 1.0, figures


class _StopAtEpochBegin(mf.callbacks.Callback):
    """Asks to stop on one worker only, before the epoch's first step (no batch hook)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1 and self.rank == 0:
            self.model.stop_training = True


class _StopInStep(mf.Model):
    """A train_step override that asks to stop on worker 1 only, at its 3rd step."""

    def train_step(self, data):
        logs = super().train_step(data)
        if self.optimizer.iterations == 3 and dist.get_rank() == 1:
            self.stop_training = True
        return logs


class _HookFromTrainBegin(mf.callbacks.Callback):
    """Gives itself a batch hook in on_train_begin; it asks to stop on worker 0 only, after the 2nd step."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def on_train_begin(self, logs=None):
        def on_train_batch_end(batch, logs=None):
            if self.rank == 0 and batch == 1:
                self.model.stop_training = True

        self.on_train_batch_end = on_train_batch_end


def _stops(rank: int, size: int) -> dict[str, tuple[int, int]]:
    strategy = mf.MultiWorkerMirroredStrategy()
    out = {}
    x, y = _data(6)
    model = _model(strategy)
    history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                        callbacks=[_StopAtEpochBegin(rank)])
    out["epoch_begin"] = (int(model.optimizer.iterations), len(history.history["loss"]))
    model = _model(strategy, _StopInStep)
    history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    out["train_step"] = (int(model.optimizer.iterations), len(history.history["loss"]))
    model = _model(strategy)
    history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                        callbacks=[_HookFromTrainBegin(rank)])
    out["hook_from_train_begin"] = (int(model.optimizer.iterations), len(history.history["loss"]))
    return out


def test_a_stop_on_one_worker_stops_both_at_the_same_step():
    results = run_distributed(_stops, world_size=2, timeout=240)
    assert results[0] == results[1], results
    # Epoch 0's 6 steps, then the stop asked for at epoch 1's beginning is agreed after its first step
    # (as Keras, which looks at stop_training after each step); that epoch still ends and is logged.
    assert results[0]["epoch_begin"] == (7, 2), results
    # The override's stop (worker 1 only) is agreed at that step: both stop after 3 steps.
    assert results[0]["train_step"] == (3, 1), results
    # A batch hook given in on_train_begin stops both workers at its step (one step later on 2+ workers, as
    # every batch-end stop), not at the epoch's end: the flags are shared at each step once it exists.
    assert results[0]["hook_from_train_begin"] == (3, 1), results


class _ReadsTestLogs(mf.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def on_test_batch_end(self, batch, logs=None):
        self.seen.append(logs["loss"])


def _validation_collectives(rank: int, size: int) -> dict[str, object]:
    """Collectives a further validation step costs inside fit (16 validation batches minus 8), and the
    logs a reader of test batch logs gets."""
    strategy = mf.MultiWorkerMirroredStrategy()
    counts = count_collectives()
    x, y = _data(4)
    out: dict[str, object] = {}
    for name, callbacks in (("plain", []), ("reader", [_ReadsTestLogs()])):
        model = _model(strategy)
        per_fit, results = [], []
        for batches in (8, 16, 8, 16):
            vx, vy = _data(batches)
            before = counts[0]
            history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks,
                                validation_data=(vx, vy))
            per_fit.append(counts[0] - before)
            results.append(history.history["val_loss"][0])
        out[name] = (per_fit[3] - per_fit[2]) / 8
        out[name + "_val_loss"] = results
        if callbacks:
            out["reader_seen"] = len(callbacks[0].seen)
    return out


def test_validation_steps_reduce_logs_only_for_a_reader():
    results = run_distributed(_validation_collectives, world_size=2, timeout=240)
    assert results[0] == results[1], results
    figures = results[0]
    # Before: the metrics were reduced after every validation step (one all-reduce a step).
    assert figures["plain"] == 0.0, figures
    assert figures["reader"] == 1.0, figures
    assert figures["reader_seen"] == 8 + 16 + 8 + 16, figures
    # The epoch's validation logs are the same with or without per-step reductions.
    assert figures["plain_val_loss"] == figures["reader_val_loss"], figures


class _StopOnOneWorker(mf.callbacks.Callback):
    """Sets stop_evaluating / stop_predicting at its 3rd batch on one worker only."""

    def __init__(self, rank: int, reads_logs: bool) -> None:
        super().__init__()
        self.rank, self.reads_logs, self.tests, self.predicts = rank, reads_logs, 0, 0

    @property
    def reads_test_batch_logs(self) -> bool:
        return self.reads_logs

    def on_test_batch_end(self, batch, logs=None):
        self.tests += 1
        if self.rank == 1 and self.tests == 3:
            self.model.stop_evaluating = True

    def on_predict_batch_end(self, batch, logs=None):
        self.predicts += 1
        if self.rank == 1 and self.predicts == 3:
            self.model.stop_predicting = True


def _stops_outside_fit(rank: int, size: int) -> dict[str, object]:
    strategy = mf.MultiWorkerMirroredStrategy()
    x, y = _data(10)
    out: dict[str, object] = {}
    for reads in (False, True):
        model = _model(strategy)
        stopper = _StopOnOneWorker(rank, reads)
        dataset = strategy.experimental_distribute_dataset(mf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))
        model.evaluate(dataset, verbose=0, callbacks=[stopper])
        out[f"tests_reads_{reads}"] = stopper.tests
    stopper = _StopOnOneWorker(rank, False)
    model = _model(strategy)
    dataset = strategy.experimental_distribute_dataset(mf.data.Dataset.from_tensor_slices(x).batch(BATCH))
    out["predicted_rows"] = len(model.predict(dataset, verbose=0, callbacks=[stopper]))
    out["predicts"] = stopper.predicts
    return out


def test_a_stop_evaluating_or_predicting_on_one_worker_ends_both_at_the_same_batch():
    results = run_distributed(_stops_outside_fit, world_size=2, timeout=240)
    assert results[0] == results[1], results
    # agreed after the batch whose hook set it; with a reader of the logs, in the next step's reduction
    assert results[0]["tests_reads_False"] == 3 and results[0]["tests_reads_True"] == 4, results
    assert results[0]["predicts"] == 3, results


class _OwnLogsStep(mf.Model):
    """A train_step override returning a dict of its own names, with a different value on each worker."""

    def train_step(self, data):
        super().train_step(data)
        return {"custom": float(self.strategy.replica_id + 1)}


def _own_epoch_logs(rank: int, size: int) -> list[float]:
    strategy = mf.MultiWorkerMirroredStrategy()
    x, y = _data(4)
    history = _model(strategy, _OwnLogsStep).fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return history.history["custom"]


def test_an_overrides_own_epoch_logs_are_one_value_on_every_worker():
    # the step's own dict is the epoch's logs (Keras); each worker's value differs, so the epoch's is their
    # mean: a saver or EarlyStopping deciding on it decides the same on every worker
    results = run_distributed(_own_epoch_logs, world_size=2, timeout=240)
    assert results[0] == results[1] == [1.5, 1.5], results
