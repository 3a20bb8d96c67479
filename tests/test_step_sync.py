"""A fit step with no per-batch log reader reads no tensor on the host (on a GPU: waits for nothing).

The metrics accumulate on the model's device, the stop/preemption flags travel on the control plane
(CPU tensors over gloo), and values are read only at log points. Counted on the CPU by patching the
reading methods of ``torch.Tensor``; tests/gpu/test_no_sync.py checks the same with CUDA's sync
debug mode on a GPU.
"""

from __future__ import annotations

import numpy as np
import torch
from _host_reads import CountDuringSteps, counting_host_reads
from _multiproc import run_distributed
from torch import nn

import meshfit as mf


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(96, 6)).astype("float32"), rng.integers(0, 3, 96)


def _model() -> mf.Model:
    torch.manual_seed(0)
    model = mf.Model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)))
    model.compile(mf.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                  mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def _fit_counting(model: mf.Model, callbacks: list = ()) -> tuple[list, int, dict]:
    x, y = _data()
    with counting_host_reads() as reads:
        counter = CountDuringSteps(reads)
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[counter, *callbacks])
    return reads, counter.steps, history.history


def test_a_step_without_log_readers_reads_nothing_on_the_host():
    reads, steps, history = _fit_counting(_model())
    assert steps == 12
    assert reads.calls == []  # one process: not even a flag is exchanged
    # The epoch logs are still computed, at the epoch's end.
    assert len(history["loss"]) == 2 and 0.0 <= history["accuracy"][-1] <= 1.0


def test_a_batch_log_reader_makes_the_steps_read_the_metrics():
    """The counter sees reads when there are some: a callback reading batch logs needs the values."""
    seen = []
    reader = mf.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(logs["loss"]))
    reads, steps, _ = _fit_counting(_model(), [reader])
    assert len(seen) == steps == 12
    assert len(reads.calls) >= steps


class _ReturnsLogs(mf.Model):
    def train_step(self, data):
        super().train_step(data)
        return {"input_mean": data[0].mean()}


def test_a_train_step_returning_tensors_is_read_at_the_epoch_end_only():
    torch.manual_seed(0)
    model = _ReturnsLogs(nn.Sequential(nn.Linear(6, 3)))
    model.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    reads, steps, history = _fit_counting(model)
    assert steps == 12 and reads.calls == []
    assert isinstance(history["input_mean"][-1], float)


def test_metric_accumulators_follow_the_device_of_their_updates():
    metric = mf.metrics.Mean()
    metric.update_state(torch.ones(4, device="meta"), sample_weight=2)  # "meta": a device that is not the CPU
    assert {t.device.type for t in metric.state_tensors()} == {"meta"}


def _worker_counts(rank: int, world: int):
    strategy = mf.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = _model()
    reads, steps, history = _fit_counting(model)
    return reads.calls, reads.outside_control_plane(), steps, history


def test_two_workers_read_only_their_control_plane_flags():
    results = run_distributed(_worker_counts, world_size=2, timeout=180)
    for calls, outside, steps, _history in results:
        assert steps == 12  # 96 examples, global batch 16 (8 a worker), 2 epochs
        # The control plane's flags; and once, at the second step, the replicas' agreement (a CPU
        # tensor on the control plane too) on whether DDP must look for unused parameters.
        probe = [c for c in outside if c[1].endswith("_collective.py:_on_every_replica")]
        assert len(probe) == 1 and [c for c in outside if c not in probe] == []
        # One read of the summed flags per step, of a CPU tensor: no device tensor round trip.
        assert len(calls) == steps + 1 and {device for _, _, device in calls} == {"cpu"}
    assert results[0][3] == results[1][3]


def _worker_with_a_log_reader(rank: int, world: int):
    import torch.distributed as dist

    strategy = mf.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = _model()
    counts = [0]  # before the first step, then one count per step (from its on_train_batch_begin)
    original = dist.all_reduce

    def counted(*args, **kwargs):
        counts[-1] += 1
        return original(*args, **kwargs)

    class ReadsLogsAndStops(mf.callbacks.Callback):
        """Reads the batch logs (so the steps reduce the metrics); worker 1 alone asks to stop at batch 2."""

        def on_train_batch_begin(self, batch, logs=None):
            counts.append(0)

        def on_train_batch_end(self, batch, logs=None):
            assert "loss" in logs  # noqa: S101 (test code)
            if rank == 1 and batch == 2:
                self.model.stop_training = True

    dist.all_reduce = counted
    try:
        x, y = _data()
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[ReadsLogsAndStops()])
    finally:
        dist.all_reduce = original
    return counts


def test_a_step_with_a_log_reader_reduces_metrics_and_flags_in_one_collective():
    results = run_distributed(_worker_with_a_log_reader, world_size=2, timeout=180)
    # Worker 1's stop reaches worker 0 with the next step's reduction: both end after batch 3.
    assert results[0] == results[1] and len(results[0]) == 1 + 4
    # The metrics' all-reduce carries the stop/preemption flags: no second collective for them
    # (the second step's one-time probe for unused parameters, and the last one's train-end, add theirs).
    assert results[0][1] == 1 and results[0][3] == 1
