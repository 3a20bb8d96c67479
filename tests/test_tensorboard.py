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


class _FlipBefore(mf.callbacks.Callback):
    """Flips one bit of a weight before optimizer step ``at`` + 1 runs, once: a faulty memory cell."""

    reads_batch_logs = False

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.done = at, False

    def on_train_batch_begin(self, batch, logs=None):
        if not self.done and self.model.optimizer.iterations == self.at:
            with torch.no_grad():
                self.model.module[1].weight.view(-1).view(torch.int32)[7] ^= 1 << 21
            self.done = True


@pytest.mark.parametrize("update_freq", [1, "epoch"])
def test_a_roll_back_writes_no_step_twice(tmp_path, update_freq):
    """`VerifyReplicas` rolls one process back across an epoch's end (5 steps an epoch; its at-rest check
    finds the bit flipped after step 6 before step 7 uses it; the backup is from step 4): TensorBoard,
    `CSVLogger` and `History` hold each step and epoch once, with the values of a run never disturbed."""
    clean = tmp_path / "clean"
    undisturbed = _fit([mf.callbacks.TensorBoard(log_dir=clean, update_freq=update_freq)])
    logs, csv = tmp_path / "logs", tmp_path / "log.csv"
    verify = mf.callbacks.VerifyReplicas(every_n_steps=1, on_divergence="restore")
    history = _fit([_FlipBefore(6), mf.callbacks.TensorBoard(log_dir=logs, update_freq=update_freq),
                    mf.callbacks.CSVLogger(csv), verify, mf.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=4)])
    assert [(e.step, e.path) for e, _ in verify.rollbacks] == [(6, "1.weight")]
    assert history.epoch == [0, 1, 2] and history.history == undisturbed.history
    assert len(csv.read_text().splitlines()) == 1 + 3
    for name in ("train", "validation"):
        got, want = _events(logs / name), _events(clean / name)
        assert sorted(got.Tags()["scalars"]) == sorted(want.Tags()["scalars"])
        for tag in want.Tags()["scalars"]:
            steps = [step for step, _ in _scalars(got, tag)]
            assert steps == sorted(set(steps)), f"{name}/{tag} holds a step twice: {steps}"
            if tag.startswith("batch_") or name == "validation" or update_freq == "epoch":
                assert _scalars(got, tag) == _scalars(want, tag)
            else:  # an epoch scalar of train/ beside batch scalars: the first written is kept
                assert steps == [step for step, _ in _scalars(want, tag)]
