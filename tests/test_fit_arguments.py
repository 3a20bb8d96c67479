"""Keras's fit arguments: validation_split, class_weight, sample_weight on every input kind,
shuffle="batch", validation_freq lists, steps_per_execution, initial_epoch; all exact on resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _interrupt import InterruptAtStepEnd
from torch import nn

import meshfit as mf


@pytest.fixture(scope="module")
def digits():
    (x, y), _ = mf.datasets.load_digits()
    return x[:100].reshape(100, 64), y[:100]


def make_model(learning_rate: float = 0.05, steps_per_execution: int = 1) -> mf.Model:
    torch.manual_seed(0)
    model = mf.Model(nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10)))
    model.compile(mf.optimizers.SGD(learning_rate=learning_rate, momentum=0.9),
                  mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  steps_per_execution=steps_per_execution)
    return model


def per_example_loss(model: mf.Model, x, y) -> torch.Tensor:
    with torch.no_grad():
        return nn.functional.cross_entropy(model.module(torch.as_tensor(x)), torch.as_tensor(y).long(),
                                           reduction="none").double()


def test_validation_split_holds_out_the_last_fifth_as_keras_does(digits):
    x, y = digits
    model = make_model()
    history = model.fit(x, y, validation_split=0.2, batch_size=16, epochs=1, verbose=0)
    # The validation logs are those of the last 20 samples, after the epoch's training.
    expected = model.evaluate(x[80:], y[80:], verbose=0, return_dict=True)
    assert history.history["val_loss"] == [pytest.approx(expected["loss"], rel=1e-6)]
    assert history.history["val_accuracy"] == [pytest.approx(expected["accuracy"])]
    # Training saw exactly the first 80 samples.
    split, plain = make_model(), make_model()
    split.fit(x, y, validation_split=0.2, batch_size=16, epochs=2, shuffle=False, verbose=0)
    plain.fit(x[:80], y[:80], batch_size=16, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(split.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"Invalid `validation_split`.*validation_split=1.5"):
        model.fit(x, y, validation_split=1.5, verbose=0)
    with pytest.raises(ValueError, match="supported only when x is arrays"):
        model.fit(mf.data.Dataset.from_tensor_slices((x, y)).batch(10), validation_split=0.2, verbose=0)


def test_class_weight_gives_the_weighted_loss_of_a_hand_computation(digits):
    x, y = digits
    class_weight = {0: 2.0, 1: 0.5, 3: 4.0}  # other classes weigh 1, as in Keras 3
    model = make_model()
    losses = per_example_loss(model, x, y)
    weights = torch.tensor([class_weight.get(int(label), 1.0) for label in y], dtype=torch.float64)
    # One batch of all 100: the logged loss is Keras's sum(w * l) / n for the weights before the update.
    history = model.fit(x, y, batch_size=100, epochs=1, class_weight=class_weight, verbose=0)
    assert history.history["loss"][0] == pytest.approx(float((weights * losses).sum() / 100), rel=1e-6)
    # Keys that are ints in another type weigh the same classes, as Keras's int(key) reads them.
    model = make_model()
    history = model.fit(x, y, batch_size=100, epochs=1, class_weight={"0": 2.0, 1.0: 0.5, np.int64(3): 4.0},
                        verbose=0)
    assert history.history["loss"][0] == pytest.approx(float((weights * losses).sum() / 100), rel=1e-6)
    # One-hot targets pick their class by argmax.
    model = mf.Model(nn.Linear(64, 10))
    torch.manual_seed(0)
    model.module.reset_parameters()
    model.compile("sgd", mf.losses.CategoricalCrossentropy(from_logits=True))
    one_hot = np.eye(10, dtype="float32")[y]
    with torch.no_grad():
        raw = nn.functional.cross_entropy(model.module(torch.as_tensor(x)), torch.as_tensor(y).long(),
                                          reduction="none").double()
    history = model.fit(x, one_hot, batch_size=100, epochs=1, class_weight=class_weight, verbose=0)
    assert history.history["loss"][0] == pytest.approx(float((weights * raw).sum() / 100), rel=1e-5)
    with pytest.raises(ValueError, match=r"Invalid `class_weight`.*'a'"):
        make_model().fit(x, y, class_weight={"a": 1.0}, verbose=0)


def test_class_weight_follows_keras_3_with_sample_weight_and_empty_dicts(digits):
    x, y = digits
    sample_weight = np.linspace(0.5, 1.5, 100).astype("float32")
    # Keras 3: "You cannot `class_weight` and `sample_weight` at the same time." (both adapters)
    with pytest.raises(ValueError, match=r"Invalid `class_weight`: it cannot be combined with `sample_weight`"):
        make_model().fit(x, y, class_weight={0: 2.0}, sample_weight=sample_weight, verbose=0)
    with pytest.raises(ValueError, match=r"cannot be combined with `sample_weight`"):
        make_model().fit(x, y, class_weight={}, sample_weight=sample_weight, verbose=0)
    yielding = mf.data.Dataset.from_tensor_slices((x, y, sample_weight)).batch(25)
    with pytest.raises(ValueError, match=r"the data yields sample weights"):
        make_model().fit(yielding, class_weight={0: 2.0}, verbose=0)
    # An empty dict weighs every class 1: the same run as no class_weight. (The weights are equal bit for
    # bit; the loss logged with weights of 1 is their sum over the batch size, without them torch's mean
    # cross-entropy: equal to float rounding.)
    plain, empty = make_model(), make_model()
    expected = plain.fit(x, y, batch_size=25, shuffle=False, verbose=0).history
    weighted = empty.fit(x, y, batch_size=25, shuffle=False, class_weight={}, verbose=0).history
    assert weighted.keys() == expected.keys()
    for key, values in expected.items():
        assert weighted[key] == pytest.approx(values, rel=1e-6)
    for a, b in zip(plain.get_weights(), empty.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    make_model().fit(yielding, class_weight={}, verbose=0)  # as Keras's dataset adapter: `if class_weight:`
    # Keras truncates int(0.5) to 0 and takes "0.0" as invalid; meshfit refuses a fraction rather than truncate.
    for key in (0.5, "0.0", -1, True):
        with pytest.raises(ValueError, match=r"Invalid `class_weight`: keys must be class indices"):
            make_model().fit(x, y, class_weight={key: 1.0}, verbose=0)


class _TorchWeighted(torch.utils.data.Dataset):
    def __init__(self, x, y, w):
        self.x, self.y, self.w = x, y, w

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], self.w[i]


def test_sample_weight_with_every_input_kind(digits):
    x, y = digits
    w = np.linspace(0.0, 2.0, 100).astype("float32")
    expected = float((torch.from_numpy(w).double() * per_example_loss(make_model(), x, y)).sum() / 100)
    inputs = {
        "arrays": dict(x=x, y=y, sample_weight=w, batch_size=100),
        "tensors": dict(x=torch.from_numpy(x), y=torch.from_numpy(y), sample_weight=torch.from_numpy(w),
                        batch_size=100),
        "Dataset": dict(x=mf.data.Dataset.from_tensor_slices((x, y, w)).batch(100)),
        "torch Dataset": dict(x=_TorchWeighted(x, y, w), batch_size=100),
        "DataLoader": dict(x=torch.utils.data.DataLoader(_TorchWeighted(x, y, w), batch_size=100)),
    }
    for kind, arguments in inputs.items():
        history = make_model().fit(**arguments, epochs=1, shuffle=False, verbose=0)
        assert history.history["loss"][0] == pytest.approx(expected, rel=1e-6), kind
    with pytest.raises(ValueError, match="Invalid `sample_weight`: when x is a Dataset"):
        make_model().fit(mf.data.Dataset.from_tensor_slices((x, y)).batch(10), sample_weight=w, verbose=0)


class RecordingModel(mf.Model):
    """Records the first feature of every example of every training batch."""

    def __init__(self, module):
        super().__init__(module)
        self.batches: list[list[float]] = []

    def train_step(self, data):
        self.batches.append(data[0][:, 0].tolist())
        return super().train_step(data)


def test_shuffle_batch_shuffles_whole_batches_every_epoch():
    x = np.arange(50, dtype="float32").reshape(50, 1).repeat(64, axis=1)
    y = np.zeros(50, dtype="int64")
    torch.manual_seed(0)
    model = RecordingModel(nn.Linear(64, 10))
    model.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=10, epochs=3, shuffle="batch", verbose=0)
    chunks = [list(range(k, k + 10)) for k in range(0, 50, 10)]
    epochs = [model.batches[i:i + 5] for i in range(0, 15, 5)]
    for batches in epochs:
        assert sorted(batches) == chunks  # each batch is a whole, ordered chunk; every chunk once
    orders = [[b[0] for b in batches] for batches in epochs]
    assert any(order != [0, 10, 20, 30, 40] for order in orders) and len({tuple(o) for o in orders}) > 1
    with pytest.raises(ValueError, match=r"Invalid `shuffle`.*shuffle='rows'"):
        model.fit(x, y, shuffle="rows", verbose=0)


def test_validation_freq_as_a_list_of_epochs(digits):
    x, y = digits
    validated: list[int] = []
    record = mf.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: validated.append(epoch) if "val_loss" in logs else None)
    history = make_model().fit(x[:80], y[:80], validation_data=(x[80:], y[80:]), validation_freq=[1, 3],
                               epochs=4, batch_size=16, verbose=0, callbacks=[record])
    assert validated == [0, 2]
    assert len(history.history["val_loss"]) == 2 and len(history.history["loss"]) == 4
    with pytest.raises(ValueError, match=r"Invalid `validation_freq`.*\[0, 2\]"):
        make_model().fit(x, y, validation_data=(x, y), validation_freq=[0, 2], verbose=0)


def test_steps_per_execution_calls_batch_callbacks_once_per_execution_and_trains_the_same(digits):
    x, y = digits
    ends: list[int] = []
    begins: list[int] = []
    record = mf.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: begins.append(batch),
                                         on_train_batch_end=lambda batch, logs: ends.append(batch))
    grouped = make_model(steps_per_execution=3)
    history = grouped.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0, callbacks=[record])
    # 10 steps an epoch: 3 + 3 + 3 + 1; Keras 3 gives the last, partial execution its nominal end (11).
    assert begins == [0, 3, 6, 9] * 2 and ends == [2, 5, 8, 11] * 2
    single = make_model()
    single_history = single.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    assert grouped.optimizer.iterations == single.optimizer.iterations == 20
    for a, b in zip(grouped.get_weights(), single.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert history.history == single_history.history
    with pytest.raises(ValueError, match=r"Invalid `steps_per_execution`.*steps_per_execution=0"):
        make_model(steps_per_execution=0)


def test_initial_epoch_starts_the_count_there(digits):
    x, y = digits
    begun: list[int] = []
    history = make_model().fit(x, y, epochs=4, initial_epoch=2, batch_size=20, verbose=0,
                               callbacks=[mf.callbacks.LambdaCallback(
                                   on_epoch_begin=lambda epoch, logs: begun.append(epoch))])
    assert begun == [2, 3] and history.epoch == [2, 3]


def test_every_argument_together_resumes_bitwise_under_backup_and_restore(digits, tmp_path):
    # make_model's torch.manual_seed(0) makes every unseeded shuffle's seed the same in each run.
    x, y = digits
    w = np.linspace(0.5, 1.5, 100).astype("float32")
    # class_weight is not combined with sample_weight here: Keras 3 refuses the two together.
    arguments = dict(validation_split=0.2, sample_weight=w, shuffle="batch",
                     validation_freq=[2, 4], initial_epoch=1, epochs=5, batch_size=16, verbose=0)
    reference = make_model(steps_per_execution=2)
    ref_history = reference.fit(x, y, **arguments)
    assert ref_history.epoch == [1, 2, 3, 4] and len(ref_history.history["val_loss"]) == 2
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="Interruption"):
        make_model(steps_per_execution=2).fit(
            x, y, **arguments, callbacks=[mf.callbacks.BackupAndRestore(backup, save_freq=4), InterruptAtStepEnd(14)])
    resumed = make_model(steps_per_execution=2)
    restore = mf.callbacks.BackupAndRestore(backup, save_freq=4)
    history = resumed.fit(x, y, **arguments, callbacks=[restore])
    # Executions end at 2, 4, 5, 7, 9, 10, 12, 14: saved at 4, 9 (crossing 8) and 12; resumed at 12.
    assert restore.restored_from.endswith("ckpt-3")
    assert history.history == ref_history.history and history.epoch == ref_history.epoch
    for a, b in zip(resumed.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_several_steps_per_execution_warn_once_about_the_users_batch_hooks(digits, tmp_path):
    import warnings

    x, y = digits

    class PerStep(mf.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    def fit(steps_per_execution, callbacks):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make_model(steps_per_execution=steps_per_execution).fit(x, y, batch_size=25, verbose=0,
                                                                    callbacks=callbacks)
        return [str(w.message) for w in caught if "steps_per_execution" in str(w.message)]

    told = fit(4, [PerStep(), mf.callbacks.LambdaCallback(on_batch_begin=lambda batch, logs: None)])
    assert len(told) == 1
    assert "compile(steps_per_execution=4)" in told[0] and "PerStep, LambdaCallback" in told[0]
    assert "once per execution of 4 steps" in told[0] and "steps_per_execution=1" in told[0]
    # meshfit's own callbacks follow executions; epoch hooks and one step an execution need no word.
    ours = [mf.callbacks.History(), mf.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=2),
            mf.callbacks.ModelCheckpoint(str(tmp_path / "best.weights.pt"), save_freq=2, save_weights_only=True),
            mf.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: None)]
    assert fit(4, ours) == []
    assert fit(1, [PerStep()]) == []
    # A LambdaCallback has the hooks it was given, no other: the loop calls none a step for epoch functions.
    epochs_only = mf.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: None)
    assert not mf.callbacks.implements_hook(epochs_only, "on_train_batch_end")
    assert not mf.callbacks.implements_hook(epochs_only, "on_train_batch_begin")
    assert mf.callbacks.implements_hook(mf.callbacks.LambdaCallback(on_batch_end=print), "on_train_batch_end")


def test_step_backups_with_several_steps_per_execution_save_each_multiple_crossed(digits, tmp_path):
    x, y = digits
    saved: list[int] = []

    class Saves(mf.callbacks.CheckpointSaver):
        def save(self):
            saved.append(self.loop.counters.iterations)
            super().save()

    model = make_model(steps_per_execution=4)
    model.fit(x, y, batch_size=10, epochs=3, shuffle=False, verbose=0,
              callbacks=[Saves(tmp_path, policy=mf.callbacks.SavePolicy(every_steps=5))])
    # Executions end at steps 4, 8, 10 | 14, 18, 20 | 24, 28, 30: each crosses at most one multiple of 5.
    assert saved == [8, 10, 18, 20, 28, 30]
