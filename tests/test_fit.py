"""Model.fit / evaluate / predict on one process: exactness, inputs, errors."""

from __future__ import annotations

import io
import os
import sys

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf


def seed_cnn(size: int = 8) -> nn.Module:
    """The seed tutorial's CNN, small: (n, size, size) images -> 10 logits."""
    return nn.Sequential(nn.Unflatten(1, (1, size)), nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(),
                         nn.LazyLinear(16), nn.ReLU(), nn.Linear(16, 10))


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


@pytest.fixture(scope="module")
def digits():
    return mf.datasets.load_digits()


def test_fit_equals_hand_written_loop_bitwise(digits):
    (x, y), _ = digits
    x, y = x[:256], y[:256]
    torch.manual_seed(0)
    ref = seed_cnn()
    ds = mf.data.Dataset.from_tensor_slices((x, y)).shuffle(256, seed=3).repeat().batch(32)
    # Reference: the same module, the same batches, a plain torch loop.
    torch.manual_seed(1)
    ref(torch.zeros(1, 8, 8))  # materialise the lazy layer with the same RNG draw fit will make
    ref_state = {k: v.clone() for k, v in ref.state_dict().items()}
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    it = iter(ds)
    for _ in range(12):
        xb, yb = next(it)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ref(xb), yb)
        loss.backward()
        opt.step()

    ds = mf.data.Dataset.from_tensor_slices((x, y)).shuffle(256, seed=3).repeat().batch(32)  # its first pass
    torch.manual_seed(0)
    module = seed_cnn()
    torch.manual_seed(1)
    module(torch.zeros(1, 8, 8))
    for k, v in module.state_dict().items():
        assert torch.equal(v, ref_state[k])
    model = mf.Model(module)
    model.compile(optimizer=mf.optimizers.SGD(learning_rate=0.05, momentum=0.9),
                  loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(ds, epochs=3, steps_per_epoch=4, verbose=0)
    for (k, v), (_, r) in zip(model.module.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(v, r), k


def test_fit_learns_digits_and_keras_output(digits, capsys):
    (x, y), (xt, yt) = digits
    torch.manual_seed(0)
    model = mf.Model(mlp())
    model.compile(optimizer=mf.optimizers.Adam(learning_rate=0.01),
                  loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    history = model.fit(x, y, batch_size=64, epochs=3, validation_data=(xt, yt), verbose=2)
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert history.history["loss"][-1] < history.history["loss"][0]
    loss, acc = model.evaluate(xt, yt, verbose=0)
    assert acc > 0.85
    assert abs(acc - history.history["val_accuracy"][-1]) < 1e-12
    out = capsys.readouterr().out
    assert "Epoch 3/3" in out and "loss:" in out and "accuracy:" in out
    assert "\r" not in out  # not a terminal: no carriage-return redraws
    predictions = model.predict(xt, batch_size=50, verbose=0)
    assert predictions.shape == (len(xt), 10)
    assert (predictions.argmax(1) == yt).mean() == pytest.approx(acc)


def test_initial_epoch_and_history(digits):
    (x, y), _ = digits
    model = mf.Model(mlp())
    model.compile("sgd", nn.CrossEntropyLoss(), metrics=["acc"])
    history = model.fit(x[:128], y[:128], batch_size=32, epochs=4, initial_epoch=2, verbose=0)
    assert history.epoch == [2, 3]
    assert len(history.history["loss"]) == 2


def test_torch_dataset_and_dataloader_inputs(digits):
    (x, y), _ = digits
    tensors = torch.utils.data.TensorDataset(torch.from_numpy(x[:96]), torch.from_numpy(y[:96]))
    model = mf.Model(mlp())
    model.compile(torch.optim.SGD(model.module.parameters(), lr=0.1), "sparse_categorical_crossentropy")
    h1 = model.fit(tensors, batch_size=32, epochs=1, verbose=0)
    loader = torch.utils.data.DataLoader(tensors, batch_size=32)
    h2 = model.fit(loader, epochs=1, verbose=0)
    assert len(h1.history["loss"]) == 1 and len(h2.history["loss"]) == 1
    assert model.optimizer.iterations == 6
    assert model.loop_state.iterations == 6


def test_torchmetrics_metric_and_sample_weight(digits):
    torchmetrics = pytest.importorskip("torchmetrics")
    (x, y), _ = digits
    model = mf.Model(mlp())
    metric = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")
    model.compile("adam", mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=[metric, "accuracy"])
    logs = model.evaluate(x[:100], y[:100], verbose=0, return_dict=True)
    assert len(logs) == 3
    values = [v for k, v in logs.items() if k != "loss"]
    assert values[0] == pytest.approx(values[1])


def test_errors_name_the_bad_value(digits, tmp_path):
    (x, y), _ = digits
    model = mf.Model(mlp())
    with pytest.raises(ValueError, match="adamz"):
        model.compile(optimizer="adamz", loss="mse")
    with pytest.raises(ValueError, match="cross_entropyy"):
        model.compile(optimizer="sgd", loss="cross_entropyy")
    with pytest.raises(ValueError, match="acuracy"):
        model.compile(optimizer="sgd", loss="mse", metrics=["acuracy"])
    with pytest.raises(RuntimeError, match="compile"):
        model.fit(x, y, verbose=0)
    model.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    infinite = mf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        model.fit(infinite, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="same number of samples"):
        model.fit(x, y[:10], verbose=0)
    with pytest.raises(RuntimeError, match="(?i)shape|size"):
        model.fit(x.reshape(len(x), -1)[:, :50], y, verbose=0)
    with pytest.raises(ValueError, match="verbose=7"):
        model.fit(x, y, verbose=7)
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        mf.load_model(os.path.join(tmp_path, "no_such_model"))
    with pytest.raises(ValueError, match="y=None"):
        model.fit(infinite, y, steps_per_epoch=1, verbose=0)


def test_save_and_load_model_resumes(digits, tmp_path):
    (x, y), (xt, yt) = digits
    torch.manual_seed(0)
    model = mf.Model(seed_cnn())
    model.compile(mf.optimizers.Adam(learning_rate=0.01), mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(x[:256], y[:256], batch_size=64, epochs=1, verbose=0, shuffle=False)
    path = os.path.join(tmp_path, "saved_model")  # the directory format (".keras" makes one zip file)
    model.save(path)
    restored = mf.load_model(path)
    np.testing.assert_array_equal(restored.predict(xt, verbose=0), model.predict(xt, verbose=0))
    # Training continues identically: optimizer state came back too.
    model.fit(x[:128], y[:128], batch_size=64, epochs=1, verbose=0, shuffle=False)
    restored.fit(x[:128], y[:128], batch_size=64, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(model.get_weights(), restored.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    # A corrupt save is reported, not half-loaded.
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(b"garbage")
    with pytest.raises(ValueError, match="model.safetensors"):
        mf.load_model(path)


def test_custom_module_needs_module_argument(tmp_path):
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(3, 2)

        def forward(self, x):
            return self.layer(x) * 2

    model = mf.Model(Custom())
    model.compile("sgd", "mse")
    path = os.path.join(tmp_path, "custom")
    model.save(path)
    with pytest.raises(ValueError, match="module="):
        mf.load_model(path)
    restored = mf.load_model(path, module=Custom())
    x = torch.randn(4, 3)
    assert torch.equal(restored(x), model(x))


def test_get_set_weights_roundtrip_and_errors():
    model = mf.Model(mlp())
    weights = model.get_weights()
    other = mf.Model(mlp(seed=5))
    other.set_weights(weights)
    for a, b in zip(other.get_weights(), weights, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="shape"):
        other.set_weights([w[..., :1] for w in weights])


def test_progbar_redraws_on_terminal(digits, monkeypatch):
    (x, y), _ = digits

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    model = mf.Model(mlp())
    model.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"])
    model.fit(x[:256], y[:256], batch_size=32, epochs=1, verbose=1)
    text = out.getvalue()
    assert "8/8 [" in text and "step" in text


def test_model_checkpoint_and_make_or_restore_model(digits, tmp_path):
    """The seed's pattern: ModelCheckpoint saves every N batches; a restart loads the newest save."""
    (x, y), _ = digits
    checkpoint_dir = str(tmp_path / "ckpt")
    os.makedirs(checkpoint_dir)

    def make_or_restore_model():
        checkpoints = [os.path.join(checkpoint_dir, name) for name in os.listdir(checkpoint_dir)]
        if checkpoints:
            return mf.load_model(max(checkpoints, key=os.path.getctime))
        model = mf.Model(mlp())
        model.compile("adam", mf.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"])
        return model

    model = make_or_restore_model()
    callback = mf.callbacks.ModelCheckpoint(filepath=checkpoint_dir + "/ckpt-loss={loss:.2f}", save_freq=5)
    model.fit(x[:320], y[:320], batch_size=32, epochs=1, verbose=0, callbacks=[callback])
    assert len(os.listdir(checkpoint_dir)) == 2  # after batches 5 and 10
    restored = make_or_restore_model()
    np.testing.assert_array_equal(restored.predict(x[:50], verbose=0), model.predict(x[:50], verbose=0))
    assert restored.optimizer.get_config()["learning_rate"] == pytest.approx(0.001)


def test_repeated_fit_calls_continue_with_fresh_passes(digits):
    """Like a new tf.data iterator, a second fit() on the same dataset does not replay its batches."""
    (x, y), _ = digits
    seen = []

    class Spy(mf.Model):
        def train_step(self, data):
            seen.append(data[1].clone())
            super().train_step(data)

    model = Spy(mlp())
    model.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    ds = mf.data.Dataset.from_tensor_slices((x[:64], y[:64])).shuffle(64, seed=0).repeat().batch(16)
    model.fit(ds, epochs=1, steps_per_epoch=2, verbose=0)
    model.fit(ds, epochs=1, steps_per_epoch=2, verbose=0)
    assert not torch.equal(seen[0], seen[2])
    finite = mf.data.Dataset.from_tensor_slices((x[:32], y[:32])).shuffle(32, seed=0).batch(32)
    seen.clear()
    model.fit(finite, epochs=1, verbose=0)
    model.fit(finite, epochs=1, verbose=0)
    assert not torch.equal(seen[0], seen[1]) and sorted(seen[0].tolist()) == sorted(seen[1].tolist())


def test_sidecar_evaluator_evaluates_the_checkpoints_training_writes(digits, tmp_path):
    (x, y), (xt, yt) = digits
    checkpoint_dir = str(tmp_path / "ckpts")
    model = mf.Model(mlp())
    model.compile("adam", mf.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"])
    saver = mf.callbacks.ModelCheckpoint(checkpoint_dir + "/ckpt-{epoch}", save_freq="epoch")
    model.fit(x[:256], y[:256], batch_size=64, epochs=2, verbose=0, callbacks=[saver])
    evaluator_model = mf.Model(mlp(seed=9))
    evaluator_model.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"])
    evaluator = mf.SidecarEvaluator(evaluator_model, (xt, yt), checkpoint_dir, max_evaluations=1, poll_interval=0.05)
    (path, logs), = evaluator.start()
    assert path.endswith("ckpt-2")  # the newest save
    assert logs == model.evaluate(xt, yt, verbose=0, return_dict=True)
    with pytest.raises(ValueError, match="max_evaluations=0"):
        mf.SidecarEvaluator(evaluator_model, (xt, yt), checkpoint_dir, max_evaluations=0)


def test_generator_input_keeps_its_first_batch_and_recompile_after_fit(digits):
    (x, y), _ = digits
    seen = []

    class Spy(mf.Model):
        def train_step(self, data):
            seen.append(int(data[1][0]))
            return super().train_step(data)

    def batches():
        for i in range(4):
            yield torch.from_numpy(x[i * 8:(i + 1) * 8]), torch.full((8,), i)

    model = Spy(mlp())
    model.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(batches(), steps_per_epoch=3, verbose=0)
    assert seen == [0, 1, 2]
    model.compile("adam", mf.losses.SparseCategoricalCrossentropy(from_logits=True))  # again, after fit
    history = model.fit(x[:64], y[:64], batch_size=32, verbose=0)
    assert model.optimizer.built and len(history.history["loss"]) == 1


def test_new_iterators_reshuffle_like_tf_data():
    ds = mf.data.Dataset.range(8).shuffle(8, seed=1)
    first, second = [int(v) for v in ds], [int(v) for v in ds]
    assert sorted(first) == sorted(second) == list(range(8)) and first != second
    again = mf.data.Dataset.range(8).shuffle(8, seed=1)
    assert [int(v) for v in again] == first  # a new pipeline object starts at the first pass again


def test_keras_style_train_step_override_returns_logs(digits):
    (x, y), _ = digits

    class Custom(mf.Model):
        def train_step(self, data):
            x, y = data
            self.optimizer.zero_grad()
            loss = nn.functional.cross_entropy(self(x), y)
            loss.backward()
            self.optimizer.step()
            return {"my_loss": loss.detach()}

    model = Custom(mlp())
    model.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x[:64], y[:64], batch_size=32, epochs=2, verbose=0)
    assert len(history.history["my_loss"]) == 2


def _train_small(jit_compile: bool) -> tuple[list[np.ndarray], mf.Model]:
    torch.manual_seed(0)
    (x, y), _ = mf.datasets.load_digits()
    model = mf.Model(nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)))
    model.compile(mf.optimizers.Adam(learning_rate=0.01), mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile)
    model.fit(x[:256], y[:256], batch_size=32, epochs=2, shuffle=False, verbose=0)
    return model.get_weights(), model


@pytest.mark.slow  # starts processes
def test_jit_compile_trains_a_compiled_module_to_the_eager_weights(monkeypatch):
    monkeypatch.setenv("MESHFIT_JIT_COMPILE_ON_CPU", "1")  # on CPU, jit_compile=True runs eagerly otherwise
    eager, _ = _train_small(False)
    jitted, model = _train_small(True)
    assert isinstance(model.placement.module, torch._dynamo.eval_frame.OptimizedModule)
    for a, b in zip(eager, jitted, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    with pytest.raises(TypeError, match="jit_compile"):
        model.compile("sgd", "mse", jit_compile="yes")
