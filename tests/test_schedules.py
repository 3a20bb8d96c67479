"""mf.optimizers.schedules: Keras's formulas, used as learning_rate=, saved and resumed exactly."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from _interrupt import InterruptAtStepEnd
from torch import nn

import meshfit as mf

schedules = mf.optimizers.schedules


def test_formulas_match_keras_by_hand():
    decay = schedules.ExponentialDecay(0.1, decay_steps=4, decay_rate=0.5)
    assert decay(0) == 0.1 and decay(4) == pytest.approx(0.05) and decay(2) == pytest.approx(0.1 * 0.5 ** 0.5)
    stairs = schedules.ExponentialDecay(0.1, decay_steps=4, decay_rate=0.5, staircase=True)
    assert [stairs(s) for s in (0, 3, 4, 7, 8)] == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025])
    piecewise = schedules.PiecewiseConstantDecay([2, 5], [1.0, 0.5, 0.25])
    assert [piecewise(s) for s in range(8)] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25]
    cosine = schedules.CosineDecay(0.2, decay_steps=10, alpha=0.1)
    assert cosine(0) == pytest.approx(0.2)
    assert cosine(5) == pytest.approx(0.2 * (0.9 * 0.5 + 0.1))
    assert cosine(10) == cosine(50) == pytest.approx(0.02)
    warm = schedules.CosineDecay(0.0, decay_steps=10, warmup_target=0.4, warmup_steps=4)
    assert [warm(s) for s in range(5)] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert warm(4 + 5) == pytest.approx(0.4 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert warm(100) == pytest.approx(0.0)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="Invalid `decay_steps`.*decay_steps=0"):
        schedules.ExponentialDecay(0.1, decay_steps=0, decay_rate=0.5)
    with pytest.raises(ValueError, match="Invalid `values`: expected 3 values"):
        schedules.PiecewiseConstantDecay([1, 2], [0.1, 0.2])
    with pytest.raises(ValueError, match="Invalid `boundaries`: expected increasing"):
        schedules.PiecewiseConstantDecay([3, 2], [0.1, 0.2, 0.3])


def _model(learning_rate) -> mf.Model:
    torch.manual_seed(0)
    model = mf.Model(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)))
    model.compile(mf.optimizers.SGD(learning_rate=learning_rate, momentum=0.9),
                  mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _digits():
    (x, y), _ = mf.datasets.load_digits()
    return x[:96], y[:96]


def test_a_schedule_sets_each_updates_rate_from_the_step_count():
    x, y = _digits()
    schedule = schedules.PiecewiseConstantDecay([3, 7], [0.1, 0.05, 0.01])
    model = _model(schedule)
    used: list[float] = []
    record = mf.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: used.append(model.optimizer.torch_optimizer.param_groups[0]["lr"]))
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[record])
    assert used == [schedule(step) for step in range(12)]
    assert model.optimizer.learning_rate == schedule(12)  # Keras: the rate of the next update
    with pytest.raises(TypeError, match="cannot be set"):
        model.optimizer.learning_rate = 0.5

    # The same updates as a plain torch loop that sets the rate by hand.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for step in range(12):
        for group in optimizer.param_groups:
            group["lr"] = schedule(step)
        batch = slice(step % 6 * 16, step % 6 * 16 + 16)
        optimizer.zero_grad()
        nn.functional.cross_entropy(module(xt[batch]), yt[batch]).backward()
        optimizer.step()
    for a, b in zip(model.get_weights(), [t.detach().numpy() for t in module.state_dict().values()], strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_schedule_is_saved_with_the_model_and_continues_where_it_was(tmp_path):
    x, y = _digits()
    schedule = schedules.CosineDecay(0.0, decay_steps=20, warmup_target=0.1, warmup_steps=5)
    model = _model(schedule)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    config = mf.optimizers.serialize(model.optimizer)
    assert json.loads(json.dumps(config))["config"]["learning_rate"] == {
        "class_name": "CosineDecay", "config": schedule.get_config()}
    restored = mf.load_model(path)
    assert isinstance(restored.optimizer._schedule, schedules.CosineDecay)
    assert restored.optimizer.iterations == 6
    assert restored.optimizer.learning_rate == schedule(6)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    restored.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), restored.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_backup_and_restore_resumes_a_schedule_exactly(tmp_path):
    x, y = _digits()

    def schedule():
        return schedules.ExponentialDecay(0.2, decay_steps=3, decay_rate=0.7)

    # shuffle=False: an unseeded shuffle's seed counts the shuffles made in this process, so runs in
    # one test process would differ by their order (separate processes, as in a real restart, do not).
    reference = _model(schedule())
    reference.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="Interruption"):
        _model(schedule()).fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                               callbacks=[mf.callbacks.BackupAndRestore(backup, save_freq=4), InterruptAtStepEnd(10)])
    resumed = _model(schedule())
    resumed.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                callbacks=[mf.callbacks.BackupAndRestore(backup, save_freq=4)])
    assert resumed.optimizer.iterations == reference.optimizer.iterations == 18
    assert resumed.optimizer.learning_rate == reference.optimizer.learning_rate
    for a, b in zip(resumed.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
