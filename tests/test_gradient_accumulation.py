"""Gradient accumulation, Keras 3's ``gradient_accumulation_steps``, behind ``fit`` and custom loops.

Accumulating 4 batches equals one batch 4 times as large (SGD within 1e-5 relative, AdamW rtol 1e-5) in
one process, on 2 workers (MultiWorkerMirroredStrategy) and fully sharded on 2 processes; ``iterations``
counts as Keras 3 counts; DDP all-reduces once per update (a counting communication hook) and a custom
loop sums once per update; a small last batch inside a window weighs by its shares; a backup taken
inside a window resumes bitwise equal to a run never stopped (1 process, 2 workers, fully sharded on
2), and one resumed on another number of processes drops its sums with a warning; bad input is
refused by name. The first tests port Keras 3's own (keras/src/optimizers/optimizer_test.py,
keras-team/keras commit 3422977a5e38fb2f7709aaa9a08e47f0c43d0f60).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf
from tests._multiproc import run_distributed

pytestmark = pytest.mark.timeout(900)  # gloo processes on a shared 2-core machine

FEATURES, CLASSES, SMALL, STEPS = 6, 3, 16, 4  # a small global batch; its accumulation window
UPDATES = 3  # updates per run: 12 small batches or 3 large ones


def _data(n: int = SMALL * STEPS * UPDATES):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, FEATURES)).astype("float32"), rng.integers(0, CLASSES, n).astype("int64")


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def _optimizer(name: str, accumulate: int | None):
    if name == "sgd":
        return mf.optimizers.SGD(0.5, momentum=0.9, gradient_accumulation_steps=accumulate)
    return mf.optimizers.AdamW(0.01, weight_decay=0.1, gradient_accumulation_steps=accumulate)


def _fit(optimizer: str, accumulate: int | None, scope=None, callbacks=(), epochs: int = 1):
    """Small batches with accumulation, or batches ``STEPS`` times larger without; the model."""
    x, y = _data()
    with scope if scope is not None else mf.get_strategy().scope():
        model = mf.Model(_module())
        model.compile(optimizer=_optimizer(optimizer, accumulate),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    batch = SMALL if accumulate else SMALL * STEPS
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks))
    return model


def _assert_close(optimizer: str, got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for a, b in zip(got, want, strict=True):
        if optimizer == "sgd":  # relative max over the weights
            assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b)), np.max(np.abs(a - b))
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# ---- Keras 3's tests, ported ----------------------------------------------------------------------
def test_gradient_accumulation():
    """keras/src/optimizers/optimizer_test.py ``test_gradient_accumulation``: SGD(1.0) with 3 steps;
    Keras's ``_accumulated_gradients`` is the parameter's ``.grad`` here (the mean after an update)."""
    v = nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    grads = torch.ones(2, 2)
    optimizer = mf.optimizers.SGD(learning_rate=1.0, gradient_accumulation_steps=3)
    assert optimizer.gradient_accumulation_steps == 3
    expected = [([[1.0, 2.0], [3.0, 4.0]], 1.0, 1, 0), ([[1.0, 2.0], [3.0, 4.0]], 2.0, 2, 0),
                ([[0.0, 1.0], [2.0, 3.0]], None, 3, 1), ([[0.0, 1.0], [2.0, 3.0]], 1.0, 4, 1)]
    for weights, accumulated, batches, iterations in expected:
        assert optimizer.apply_gradients([(grads, v)]) == batches
        torch.testing.assert_close(v.detach(), torch.tensor(weights))
        if accumulated is not None:
            torch.testing.assert_close(v.grad, torch.full((2, 2), accumulated))
        assert (optimizer.batches, optimizer.iterations) == (batches, iterations)  # Keras's _iterations, iterations


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad"])
def test_gradient_accumulation_with_weigth_decay(name):
    """keras/src/optimizers/optimizer_test.py ``test_gradient_accumulation_with_weigth_decay`` (Keras's
    spelling): weight_decay=0.05, 3 steps of accumulation equal one step on the 3 gradients' mean."""
    one = mf.optimizers.get({"class_name": name, "config": {"learning_rate": 0.01, "weight_decay": 0.05}})
    three = mf.optimizers.get({"class_name": name, "config": {"learning_rate": 0.01, "weight_decay": 0.05,
                                                              "gradient_accumulation_steps": 3}})
    v1, v3 = nn.Parameter(torch.tensor([[0.9], [0.5]])), nn.Parameter(torch.tensor([[0.9], [0.5]]))
    rng = np.random.default_rng(0)
    for _ in range(8):
        grads = torch.from_numpy(rng.random((3, 2, 1)).astype("float32"))
        one.apply_gradients([(grads.mean(0), v1)])
        for batch in range(3):
            three.apply_gradients([(grads[batch], v3)])
    torch.testing.assert_close(v3.detach(), v1.detach(), rtol=1e-5, atol=1e-6)
    assert (one.iterations, three.iterations, three.batches) == (8, 8, 24)


def test_the_argument_is_serialized_and_a_schedule_reads_every_batch():
    optimizer = mf.optimizers.AdamW(1e-3, gradient_accumulation_steps=4)
    config = mf.optimizers.serialize(optimizer)
    assert config["config"]["gradient_accumulation_steps"] == 4
    assert mf.optimizers.deserialize(config).gradient_accumulation_steps == 4
    assert mf.optimizers.SGD(0.1).get_config()["gradient_accumulation_steps"] is None
    # Keras 3: the schedule reads the batch counter (``_iterations``); the update on batch 4 uses rate(3)
    schedule = mf.optimizers.schedules.ExponentialDecay(1.0, decay_steps=1, decay_rate=0.5)
    v = nn.Parameter(torch.zeros(1))
    sgd = mf.optimizers.SGD(schedule, gradient_accumulation_steps=4)
    for _ in range(4):
        sgd.apply_gradients([(torch.ones(1), v)])
    torch.testing.assert_close(v.detach(), torch.tensor([-0.125]))
    assert sgd.learning_rate == pytest.approx(0.0625)


def test_the_moving_average_folds_in_weights_at_updates_only():
    v = nn.Parameter(torch.zeros(1))
    sgd = mf.optimizers.SGD(1.0, use_ema=True, ema_momentum=0.5, gradient_accumulation_steps=2)
    for _ in range(4):
        sgd.apply_gradients([(torch.ones(1), v)])  # updates on batches 2 and 4: weights -1, then -2
    sgd.finalize_variable_values()
    torch.testing.assert_close(v.detach(), torch.tensor([-1.5]))  # 0.5 * -1 + 0.5 * -2


@pytest.mark.parametrize("value", [0, -2, 2.0, "4", True])
def test_bad_accumulation_steps_are_refused_by_name(value):
    with pytest.raises(ValueError, match=r"Invalid `gradient_accumulation_steps`: .*received "
                                         rf"gradient_accumulation_steps={value!r}\. Pass e\.g\."):
        mf.optimizers.Adam(1e-3, gradient_accumulation_steps=value)


def test_mixed_float16_does_not_take_an_accumulating_optimizer():
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4.*mixed_bfloat16"):
        mf.mixed_precision.LossScaleOptimizer(mf.optimizers.SGD(0.1, gradient_accumulation_steps=4))


# ---- fit, one process ------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fit_accumulating_four_batches_equals_one_batch_four_times_as_large(optimizer):
    large = _fit(optimizer, None)
    small = _fit(optimizer, STEPS)
    _assert_close(optimizer, small.get_weights(), large.get_weights())
    assert (small.optimizer.iterations, small.optimizer.batches) == (UPDATES, UPDATES * STEPS)  # Keras's counts
    assert large.optimizer.iterations == UPDATES


def test_zero_grad_inside_a_window_keeps_the_sum_in_a_custom_loop():
    x, y = (torch.from_numpy(a) for a in _data())
    module, plain = _module(), _module()
    optimizer = mf.optimizers.SGD(0.5, gradient_accumulation_steps=STEPS)
    optimizer.build(module.parameters())
    reference = mf.optimizers.SGD(0.5)
    reference.build(plain.parameters())
    loss = nn.CrossEntropyLoss()
    for i in range(STEPS * UPDATES):
        rows = slice(i * SMALL, (i + 1) * SMALL)
        optimizer.zero_grad()
        loss(module(x[rows]), y[rows]).backward()
        optimizer.step()
        if (i + 1) % STEPS == 0:
            rows = slice((i + 1 - STEPS) * SMALL, (i + 1) * SMALL)
            reference.zero_grad()
            loss(plain(x[rows]), y[rows]).backward()
            reference.step()
    _assert_close("sgd", [p.detach().numpy() for p in module.parameters()],
                  [p.detach().numpy() for p in plain.parameters()])


# ---- several processes -----------------------------------------------------------------------------
def _on_workers(rank, world, optimizer, layout):
    import meshfit as mf

    if layout == "fully_sharded":
        scope = mf.dtensor.LayoutMap.fully_sharded(mf.dtensor.create_mesh([("batch", world)])).scope()
    else:
        scope = mf.MultiWorkerMirroredStrategy().scope()
    model = _fit(optimizer, STEPS, scope)
    return model.get_weights(), model.optimizer.iterations


@pytest.mark.parametrize("layout", ["multiworker", "fully_sharded"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_on_two_processes_accumulating_equals_one_process_on_the_large_batch(optimizer, layout):
    want = _fit(optimizer, None).get_weights()
    results = run_distributed(_on_workers, world_size=2, args=(optimizer, layout), timeout=400)
    for weights, iterations in results:
        assert iterations == UPDATES
        _assert_close(optimizer, weights, want)


def _uneven(rank, world):
    """2 epochs of batches 16, 16, 5: a window holds the small batch inside it, and the last window ends
    on it (uneven on 2 workers: 3 and 2 rows)."""
    import meshfit as mf

    x, y = _data(2 * SMALL + 5)
    with mf.MultiWorkerMirroredStrategy().scope() if world > 1 else mf.get_strategy().scope():
        model = mf.Model(_module())
        model.compile(optimizer=_optimizer("sgd", STEPS), loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=SMALL, epochs=3, shuffle=False, verbose=0)
    return model.get_weights()


def test_an_uneven_batch_inside_a_window_counts_as_one_process_counts_it():
    """Each replica's gradient of a small last batch weighs by its share of that batch, also when it
    is summed locally inside a window (and not only the window's last batch's)."""
    want = run_distributed(_uneven, world_size=1, timeout=400)[0]
    for weights in run_distributed(_uneven, world_size=2, timeout=400):
        _assert_close("sgd", weights, want)


def _custom_loop(rank, world, accumulate):
    """TensorFlow's custom loop on 2 workers: strategy.run, compute_average_loss, apply_gradients; each
    worker's rows of 4 global batches of 8. Returns the weights and the gradient sums after each batch."""
    import meshfit as mf

    strategy = mf.MultiWorkerMirroredStrategy()
    with strategy.scope():
        module = _module()
        optimizer = mf.optimizers.SGD(0.5, gradient_accumulation_steps=accumulate)
    sums = [0]
    all_reduce_sum = strategy.all_reduce_sum

    def counted(tensor):
        sums[0] += 1
        return all_reduce_sum(tensor)

    strategy.all_reduce_sum = counted  # the one collective the optimizer step sums gradients with
    x, y = (torch.from_numpy(a) for a in _data(8 * STEPS))
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    after = []
    batches = [slice(8 * i, 8 * (i + 1)) for i in range(STEPS)] if accumulate else [slice(0, 8 * STEPS)]
    for rows in batches:
        mine = slice(rows.start + rank * (rows.stop - rows.start) // 2, rows.start + (rank + 1) * (rows.stop - rows.start) // 2)

        def step(xb, yb, size):
            loss = mf.nn.compute_average_loss(loss_fn(module(xb), yb), global_batch_size=size)
            grads = torch.autograd.grad(loss, list(module.parameters()))
            optimizer.apply_gradients(zip(grads, module.parameters(), strict=True))

        strategy.run(step, args=(x[mine], y[mine], rows.stop - rows.start))
        after.append(sums[0])
    return [p.detach().numpy() for p in module.parameters()], after


def test_a_custom_loop_sums_the_replicas_gradients_once_per_update():
    """apply_gradients inside strategy.run: the replicas' sums meet once, at the window's last batch."""
    accumulated = run_distributed(_custom_loop, world_size=2, args=(STEPS,), timeout=400)
    large = run_distributed(_custom_loop, world_size=2, args=(None,), timeout=400)
    for (weights, after), (want, plain_after) in zip(accumulated, large, strict=True):
        assert after == [0] * (STEPS - 1) + [plain_after[0]] and plain_after[0] >= 1
        _assert_close("sgd", weights, want)


def _counted_all_reduces(rank, world, accumulate):
    """The buckets DDP all-reduced after each batch of 2 epochs (a counting communication hook)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    import meshfit as mf
    from meshfit.distribute import _collective

    calls = [0]

    class Counting(DistributedDataParallel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

            def hook(group, bucket):
                calls[0] += 1
                return default_hooks.allreduce_hook(group, bucket)

            self.register_comm_hook(self.process_group, hook)

    class Record(mf.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.after = []

        def on_train_batch_end(self, batch, logs=None):
            self.after.append(calls[0])

    _collective.DistributedDataParallel = Counting  # meshfit builds its DDP wrappers with this name
    record = Record()
    model = _fit("sgd", accumulate, mf.MultiWorkerMirroredStrategy().scope(), callbacks=[record], epochs=2)
    return record.after, model.get_weights()


def test_ddp_all_reduces_once_per_update_and_never_on_the_other_batches():
    after, weights = run_distributed(_counted_all_reduces, world_size=2, args=(STEPS,), timeout=400)[0]
    # one bucket (a small model) after each 4th batch, none on the three before it
    assert after == [(i + 1) // STEPS for i in range(2 * STEPS * UPDATES)]
    plain, _ = run_distributed(_counted_all_reduces, world_size=2, args=(None,), timeout=400)[0]
    assert plain == list(range(1, 2 * UPDATES + 1))  # the counter counts: one a batch without accumulation
    want = _fit("sgd", None, epochs=2).get_weights()
    _assert_close("sgd", weights, want)


class _Stop(Exception):
    pass


def _resumable(rank, world, backup, stop_at, workers):
    """2 epochs of 12 batches with a backup after every batch; raise before batch ``stop_at`` (counted
    over the run), or run to the end; the weights, the optimizer's counters and the warnings."""
    import warnings

    import meshfit as mf

    class Interrupt(mf.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if stop_at is not None and self.model.optimizer.batches == stop_at:
                raise _Stop

    if workers == "fully_sharded":
        scope = mf.dtensor.LayoutMap.fully_sharded(mf.dtensor.create_mesh([("batch", world)])).scope()
    else:
        scope = mf.MultiWorkerMirroredStrategy().scope() if workers else None
    callbacks = [mf.callbacks.BackupAndRestore(backup, save_freq=1, async_save=False, delete_checkpoint=False),
                 Interrupt()]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = _fit("adamw", STEPS, scope, callbacks=callbacks, epochs=2)
    except _Stop:
        return None
    return model.get_weights(), model.optimizer.batches, model.optimizer.iterations, [str(w.message) for w in caught]


@pytest.mark.parametrize(("world", "workers"), [(1, False), (2, True), (2, "fully_sharded")],
                         ids=["one-process", "two-workers", "fully-sharded-two"])
def test_a_backup_inside_a_window_resumes_bitwise_equal_to_a_run_never_stopped(tmp_path, world, workers):
    stop_at = STEPS * UPDATES + STEPS + 2  # 18: the second epoch's second window, after 2 of its 4 batches
    whole = run_distributed(_resumable, world_size=world, args=(str(tmp_path / "whole"), None, workers),
                            timeout=400)
    backup = str(tmp_path / "backup")
    stopped = run_distributed(_resumable, world_size=world, args=(backup, stop_at, workers), timeout=400)
    assert stopped == [None] * world
    resumed = run_distributed(_resumable, world_size=world, args=(backup, None, workers), timeout=400)
    for (weights, batches, iterations, caught), (want, *_) in zip(resumed, whole, strict=True):
        assert (batches, iterations) == (2 * STEPS * UPDATES, 2 * UPDATES)
        assert not [w for w in caught if "accumulation" in w], caught
        for got, expected in zip(weights, want, strict=True):
            np.testing.assert_array_equal(got, expected)


def test_sums_saved_by_other_processes_are_dropped_with_a_warning(tmp_path):
    """Two workers' sums cannot be split again for one process: the window restarts its sums, said once."""
    backup = str(tmp_path / "backup")
    assert run_distributed(_resumable, world_size=2, args=(backup, STEPS * UPDATES + 2, True),
                           timeout=400) == [None, None]
    (weights, batches, iterations, caught), = run_distributed(_resumable, world_size=1, args=(backup, None, False),
                                                              timeout=400)
    assert (batches, iterations) == (2 * STEPS * UPDATES, 2 * UPDATES)
    dropped = [w for w in caught if "inside a gradient accumulation window by 2 processes; 1 resume it" in w]
    assert len(dropped) == 1, caught
    assert all(np.isfinite(w).all() for w in weights)


def _stops(rank, world, at, reads_logs):
    """Rank 0 alone asks to stop at the end of batch ``at``; the batches each worker ran."""
    import meshfit as mf

    class Stop(mf.callbacks.Callback):
        reads_batch_logs = reads_logs  # a callback reading per-batch logs has them reduced every batch

        def on_train_batch_end(self, batch, logs=None):
            if rank == 0 and self.model.optimizer.batches == at:
                self.model.stop_training = True

    model = _fit("sgd", STEPS, mf.MultiWorkerMirroredStrategy().scope(), callbacks=[Stop()])
    return model.optimizer.batches


@pytest.mark.parametrize(("reads_logs", "stopped_at"), [(False, 2 * STEPS), (True, 6)])
def test_on_two_workers_a_stop_inside_a_window_takes_effect_at_its_last_batch(reads_logs, stopped_at):
    """No collective inside a window: the replicas agree on a stop asked at batch 5 with the window's last
    batch (8), and every worker stops there (none waits for a peer that stopped). With per-batch logs
    reduced anyway, the stop travels with the next batch's reduction, as without accumulation."""
    assert run_distributed(_stops, world_size=2, args=(5, reads_logs), timeout=400) == [stopped_at] * 2


class _FirstOfWindow(nn.Module):
    """A layer used only on the first batch of each 2-batch window: it gets gradients on batches that stay
    on the replica, never on a batch that goes through the DDP wrapper."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.extra = nn.Linear(FEATURES, CLASSES), nn.Linear(FEATURES, CLASSES)
        self.calls = 0

    def forward(self, x):
        out = self.body(x)
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls % 2 == 1:
                out = out + self.extra(x)
        return out


def _first_of_window(rank, world):
    import meshfit as mf

    x, y = _data()
    with mf.MultiWorkerMirroredStrategy().scope() if world > 1 else mf.get_strategy().scope():
        model = mf.Model(_FirstOfWindow())
        model.compile(optimizer=mf.optimizers.SGD(0.5, gradient_accumulation_steps=2),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=SMALL, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


def test_a_layer_used_only_on_batches_that_stay_local_trains_as_in_one_process():
    """The unused-parameter probe counts what the wrapper's own batches use: a layer trained only inside
    windows makes DDP look for unused parameters (it raised torch's 'mark a variable ready only once')."""
    want = run_distributed(_first_of_window, world_size=1, timeout=400)[0]
    for weights in run_distributed(_first_of_window, world_size=2, timeout=400):
        _assert_close("sgd", weights, want)
