"""TensorBoard files from a real fit, read back with tensorboard's own event reader."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import meshfit as mf


def _events(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    return accumulator


def _scalars(accumulator, tag):
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def _fit(callbacks, epochs=3):
    (x, y), (xv, yv) = mf.datasets.load_digits()
    torch.manual_seed(0)
    model = mf.Model(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)))
    model.compile(mf.optimizers.SGD(learning_rate=0.05), mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model.fit(x[:160], y[:160], validation_data=(xv[:64], yv[:64]), batch_size=32, epochs=epochs,
                     shuffle=False, verbose=0, callbacks=callbacks)


def test_epoch_scalars_match_the_history(tmp_path):
    history = _fit([mf.callbacks.TensorBoard(log_dir=tmp_path / "logs")])
    train, validation = _events(tmp_path / "logs" / "train"), _events(tmp_path / "logs" / "validation")
    for name in ("loss", "accuracy"):
        assert _scalars(train, f"epoch_{name}") == [(e, pytest.approx(v)) for e, v in enumerate(history.history[name])]
        assert _scalars(validation, f"epoch_{name}") == [
            (e, pytest.approx(v)) for e, v in enumerate(history.history[f"val_{name}"])]
    assert _scalars(train, "epoch_learning_rate") == [(e, pytest.approx(0.05)) for e in range(3)]
    assert not [tag for tag in train.Tags()["scalars"] if tag.startswith("batch_")]  # update_freq="epoch"


def test_batch_scalars_every_update_freq_batches(tmp_path):
    batch_losses: list[float] = []
    record = mf.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: batch_losses.append(logs["loss"]))
    _fit([mf.callbacks.TensorBoard(log_dir=tmp_path / "logs", update_freq=2), record], epochs=2)
    train = _events(tmp_path / "logs" / "train")
    # 5 batches an epoch: global batches 2, 4, ..., 10 (1-based), each the running loss of its step.
    assert _scalars(train, "batch_loss") == [(step, pytest.approx(batch_losses[step - 1])) for step in (2, 4, 6, 8, 10)]
    assert [step for step, _ in _scalars(train, "batch_accuracy")] == [2, 4, 6, 8, 10]
