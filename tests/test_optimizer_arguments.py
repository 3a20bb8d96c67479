"""Keras 3's common optimizer arguments on every meshfit optimizer (issue 25, point 13): ``clipnorm``,
``clipvalue``, ``global_clipnorm`` (clipping the gradient reduced across replicas), ``use_ema`` /
``ema_momentum`` / ``ema_overwrite_frequency`` (saved in ``state_dict``), ``exclude_from_weight_decay``,
torch parameter groups under rate changes, and a torch optimizer class as ``optimizer=`` (point 12).

Expected values are Keras's own (``keras/src/optimizers/optimizer_test.py``) where Keras states them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _interrupt import InterruptAtStepEnd
from _multiproc import run_distributed
from torch import nn

import meshfit as mf
from meshfit.optimizers import SGD, Adagrad, Adam, AdamW, RMSprop

BUILTIN = (SGD, Adam, AdamW, RMSprop, Adagrad)


def _variable(values) -> nn.Parameter:
    return nn.Parameter(torch.tensor(values, dtype=torch.float32))


# ---- clipping ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", BUILTIN)
def test_every_optimizer_takes_keras_clip_arguments_one_at_a_time(cls):
    # Keras's test_clip_args, on each optimizer meshfit has.
    assert cls(clipnorm=0.1).clipnorm == 0.1
    assert cls(clipvalue=0.1).clipvalue == 0.1
    assert cls(global_clipnorm=0.1).global_clipnorm == 0.1
    with pytest.raises(ValueError, match="Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can"):
        cls(clipnorm=0.1, clipvalue=0.1)
    with pytest.raises(ValueError, match="Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can"):
        cls(clipnorm=0.1, global_clipnorm=0.1)
    with pytest.raises(ValueError, match=r"Invalid `clipnorm`: expected a positive number.*clipnorm=-1"):
        cls(clipnorm=-1)
    config = cls(global_clipnorm=2.0, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=3).get_config()
    assert {k: config[k] for k in ("clipnorm", "clipvalue", "global_clipnorm", "use_ema", "ema_momentum",
                                   "ema_overwrite_frequency")} == {
        "clipnorm": None, "clipvalue": None, "global_clipnorm": 2.0, "use_ema": True, "ema_momentum": 0.5,
        "ema_overwrite_frequency": 3}
    again = mf.optimizers.deserialize(mf.optimizers.serialize(cls.from_config(config)))
    assert again.global_clipnorm == 2.0 and again.use_ema and again.ema_overwrite_frequency == 3


def _applied(gradients, **clip) -> list[np.ndarray]:
    """The update SGD(learning_rate=1) makes from zero weights: minus the clipped gradients."""
    variables = [_variable(np.zeros(np.shape(g))) for g in gradients]
    SGD(learning_rate=1.0, **clip).apply_gradients(
        zip([torch.tensor(g, dtype=torch.float32) for g in gradients], variables, strict=True))
    return [-v.detach().numpy() for v in variables]


def test_clipping_follows_keras_formulas():
    # Keras's test_clip_norm, test_clip_value and test_global_clip_norm.
    np.testing.assert_allclose(_applied([[2.0, 2.0]], clipnorm=1)[0], [2**0.5 / 2, 2**0.5 / 2], rtol=1e-6)
    np.testing.assert_allclose(_applied([[2.0, 2.0]], clipvalue=1)[0], [1.0, 1.0])
    grads = [[3.0, 0.0], [0.0, 4.0]]  # global norm 5
    for got, grad in zip(_applied(grads, global_clipnorm=1), grads, strict=True):
        np.testing.assert_allclose(got, np.array(grad) / 5.0, rtol=1e-6)
    # clipnorm clips each gradient on its own; small gradients are left alone.
    got = _applied([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]], clipnorm=1)
    np.testing.assert_allclose(got[0], [0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(got[1], [0.3, 0.4], rtol=1e-6)
    np.testing.assert_array_equal(got[2], [0.0, 0.0])
    # A non-finite global norm gives NaN gradients, as Keras's clip_by_global_norm.
    assert np.isnan(_applied([[math.inf, 1.0]], global_clipnorm=1)[0]).all()


def test_clipping_applies_in_fit():
    torch.manual_seed(0)
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("f4") * 100
    y = np.zeros((16, 1), "f4")

    def trained(**clip):
        torch.manual_seed(0)
        model = mf.Model(nn.Linear(4, 1))
        model.compile(SGD(learning_rate=0.1, **clip), "mse")
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return model

    plain = trained()
    clipped = trained(global_clipnorm=1.0)
    torch.manual_seed(0)
    reference = nn.Linear(4, 1)
    loss = nn.functional.mse_loss(reference(torch.from_numpy(x)), torch.from_numpy(y))
    grads = torch.autograd.grad(loss, list(reference.parameters()))
    norm = torch.sqrt(sum((g**2).sum() for g in grads))
    assert norm > 1  # so the clip bites
    expected = [(p - 0.1 * g / norm).detach().numpy() for p, g in zip(reference.parameters(), grads, strict=True)]
    for got, want in zip(clipped.get_weights(), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(plain.get_weights()[0], clipped.get_weights()[0])


# ---- clipping after the reduction across replicas, on 2 gloo workers ------------------------------
_GLOBAL_X = np.random.default_rng(1).normal(size=(8, 3)).astype("f4") * 10
_GLOBAL_X[4:] *= 5  # the two replicas' halves have very different gradient norms
_GLOBAL_Y = np.random.default_rng(2).normal(size=(8, 1)).astype("f4")
_CLIPS = ({"global_clipnorm": 0.5}, {"clipnorm": 0.5}, {"clipvalue": 0.05})


def _one_process_weights(clip: dict) -> list[np.ndarray]:
    torch.manual_seed(0)
    model = mf.Model(nn.Linear(3, 1))
    model.compile(mf.optimizers.Adam(learning_rate=0.1, **clip), "mse")
    model.fit(_GLOBAL_X, _GLOBAL_Y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    return model.get_weights()


def _custom_loop_weights(module: nn.Module, optimizer: mf.optimizers.Optimizer, x, y, strategy=None):
    for _ in range(3):
        def step():
            per_example = ((module(torch.from_numpy(x)) - torch.from_numpy(y)) ** 2).squeeze(1)
            return mf.nn.compute_average_loss(per_example, global_batch_size=8)

        loss = step() if strategy is None else strategy.experimental_local_results(strategy.run(step))[0]
        grads = torch.autograd.grad(loss, list(module.parameters()))
        optimizer.apply_gradients(zip(grads, module.parameters(), strict=True))
    return [p.detach().numpy().copy() for p in module.parameters()]


def _two_workers(rank: int, world: int):
    strategy = mf.MultiWorkerMirroredStrategy()
    rows = slice(4 * rank, 4 * rank + 4)
    fitted, looped = [], []
    for clip in _CLIPS:
        torch.manual_seed(0)
        with strategy.scope():
            model = mf.Model(nn.Linear(3, 1))
            model.compile(mf.optimizers.Adam(learning_rate=0.1, **clip), "mse")
        # fit splits the global batch of 8 evenly: this worker trains on its 4 rows.
        model.fit(_GLOBAL_X, _GLOBAL_Y, batch_size=8, epochs=3, shuffle=False, verbose=0)
        fitted.append(model.get_weights())
        torch.manual_seed(0)
        with strategy.scope():
            module = nn.Linear(3, 1)
            optimizer = mf.optimizers.Adam(learning_rate=0.1, **clip)
        looped.append(_custom_loop_weights(module, optimizer, _GLOBAL_X[rows], _GLOBAL_Y[rows], strategy))
    return fitted, looped


def test_clipping_on_two_workers_equals_one_process_on_the_global_batch():
    (fit0, loop0), (fit1, loop1) = run_distributed(_two_workers, timeout=240)
    for i, clip in enumerate(_CLIPS):
        single_fit = _one_process_weights(clip)
        torch.manual_seed(0)
        module = nn.Linear(3, 1)
        single_loop = _custom_loop_weights(module, mf.optimizers.Adam(learning_rate=0.1, **clip), _GLOBAL_X,
                                           _GLOBAL_Y)
        for a, b, want in zip(fit0[i], fit1[i], single_fit, strict=True):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-6, err_msg=f"fit {clip}")
        for a, b, want in zip(loop0[i], loop1[i], single_loop, strict=True):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-6, err_msg=f"custom loop {clip}")


# ---- moving average of the weights ---------------------------------------------------------------
def test_ema_follows_keras_test_ema():
    v = _variable([[3.0, 4.0], [5.0, 6.0]])
    grads = torch.ones(2, 2)
    optimizer = SGD(learning_rate=1.0, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3)
    optimizer.apply_gradients([(grads, v)])
    np.testing.assert_allclose(v.detach(), [[2.0, 3.0], [4.0, 5.0]])
    np.testing.assert_allclose(optimizer.state_dict()["ema"]["0"], [[2.0, 3.0], [4.0, 5.0]])  # first step
    optimizer.apply_gradients([(grads, v)])
    np.testing.assert_allclose(v.detach(), [[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_allclose(optimizer.state_dict()["ema"]["0"], [[1.9, 2.9], [3.9, 4.9]], rtol=1e-6)
    optimizer.apply_gradients([(grads, v)])
    np.testing.assert_allclose(v.detach(), [[1.71, 2.71], [3.71, 4.71]], rtol=1e-6)  # overwritten with the EMA
    with pytest.raises(ValueError, match=r"Invalid `ema_momentum`: expected a number in \[0, 1\]"):
        SGD(use_ema=True, ema_momentum=1.5)
    with pytest.raises(ValueError, match=r"Invalid `ema_overwrite_frequency`"):
        SGD(use_ema=True, ema_overwrite_frequency=0)


def test_ema_with_model_fit_follows_keras():
    # Keras's test_ema_with_model_fit: Dense(2, kernel "ones", no bias), mse, SGD(0.1), momentum 0.9, 2 steps.
    optimizer = SGD(learning_rate=0.1, use_ema=True, ema_momentum=0.9)
    module = nn.Linear(1, 2, bias=False)
    nn.init.ones_(module.weight)
    model = mf.Model(module)
    model.compile(optimizer, "mse")
    model.fit(np.ones((1, 1), "f4"), np.zeros((1, 2), "f4"), batch_size=1, epochs=2, verbose=0)
    np.testing.assert_allclose(optimizer.state_dict()["ema"]["0"], [[0.891], [0.891]], atol=1e-5)
    np.testing.assert_allclose(module.weight.detach(), [[0.891], [0.891]], atol=1e-5)  # finalized by fit


def _ema_model() -> mf.Model:
    torch.manual_seed(0)
    model = mf.Model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    optimizer = AdamW(learning_rate=0.05, weight_decay=0.1, global_clipnorm=0.5, use_ema=True,
                      ema_momentum=0.8, ema_overwrite_frequency=5)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    model.compile(optimizer, "mse")
    return model


def test_ema_and_clipping_resume_bitwise_under_backup_and_restore(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 4)).astype("f4") * 3, rng.normal(size=(40, 1)).astype("f4")
    arguments = dict(batch_size=8, epochs=4, shuffle=False, verbose=0)
    reference = _ema_model()
    reference.fit(x, y, **arguments)
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="Interruption"):
        _ema_model().fit(x, y, **arguments,
                         callbacks=[mf.callbacks.BackupAndRestore(backup, save_freq=3), InterruptAtStepEnd(13)])
    resumed = _ema_model()
    resumed.fit(x, y, **arguments, callbacks=[mf.callbacks.BackupAndRestore(backup, save_freq=3)])
    for a, b in zip(resumed.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(resumed.optimizer.state_dict()["ema"].values(), reference.optimizer.state_dict()["ema"].values(),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---- weight decay exemptions ---------------------------------------------------------------------
def test_exclude_from_weight_decay_by_variable_or_name_as_keras():
    # Keras's adamw test: with zero gradients only weight decay moves a variable; exempt ones stay at 2.
    var1, var3 = _variable(2.0), _variable(2.0)
    zero = torch.zeros(())
    by_list = AdamW(learning_rate=1.0, weight_decay=0.004)
    by_list.exclude_from_weight_decay(var_list=[var3])
    by_list.apply_gradients([(zero, var1), (zero, var3)])
    assert float(var1.detach()) == pytest.approx(2.0 * (1 - 0.004)) and float(var3.detach()) == 2.0
    # By name: a parameter's path in its module (Model builds the optimizer on named_parameters()).
    module = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(2.0)
    optimizer = AdamW(learning_rate=1.0, weight_decay=0.004)
    optimizer.exclude_from_weight_decay(var_names=["bias", r"^1\."])
    model = mf.Model(module)
    model.compile(optimizer, lambda y_true, y_pred: (y_pred * 0.0).sum())  # zero gradients
    model.fit(np.ones((2, 2), "f4"), np.ones((2, 2), "f4"), batch_size=2, verbose=0)
    after = dict(module.named_parameters())
    assert torch.allclose(after["0.weight"], torch.full((2, 2), 2.0 * (1 - 0.004)))
    for name in ("0.bias", "1.weight", "1.bias"):
        assert torch.equal(after[name], torch.full_like(after[name], 2.0)), name
    with pytest.raises(ValueError, match=r"can only be configured before the optimizer is built"):
        optimizer.exclude_from_weight_decay(var_names=["weight"])


# ---- torch optimizers: parameter groups, classes -------------------------------------------------
def test_torch_parameter_groups_keep_their_ratios_under_rate_changes():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 1))
    torch_optimizer = torch.optim.SGD([{"params": module[0].parameters(), "lr": 0.1},
                                       {"params": module[1].parameters(), "lr": 0.01}])
    model = mf.Model(module)
    model.compile(torch_optimizer, "mse")
    schedule = mf.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.5)
    model.fit(np.ones((4, 2), "f4"), np.ones((4, 1), "f4"), batch_size=2, epochs=2, callbacks=[schedule], verbose=0)
    rates = [group["lr"] for group in torch_optimizer.param_groups]
    assert rates == pytest.approx([0.025, 0.0025])  # halved twice, the 10:1 ratio kept
    assert model.optimizer.learning_rate == pytest.approx(0.025)
    model.optimizer.learning_rate = 0.2
    assert [group["lr"] for group in torch_optimizer.param_groups] == pytest.approx([0.2, 0.02])


def test_a_torch_optimizer_class_is_built_on_the_models_parameters():
    torch.manual_seed(0)
    model = mf.Model(nn.Linear(2, 1))
    model.compile(optimizer=torch.optim.Adam, loss="mse")
    before = model.get_weights()
    model.fit(np.ones((4, 2), "f4"), np.zeros((4, 1), "f4"), batch_size=2, verbose=0)
    built = model.optimizer.torch_optimizer
    assert type(built) is torch.optim.Adam and built.param_groups[0]["lr"] == 0.001  # torch's default
    assert {id(p) for p in built.param_groups[0]["params"]} == {id(p) for p in model.module.parameters()}
    assert not np.allclose(before[0], model.get_weights()[0])

    class NoDefault(torch.optim.SGD):
        def __init__(self, params, lr):
            super().__init__(params, lr=lr)

    with pytest.raises(ValueError, match=r"NoDefault has no default learning rate.*NoDefault\(model.parameters\(\), "
                                         r"lr=\.\.\.\)"):
        mf.Model(nn.Linear(2, 1)).compile(optimizer=NoDefault, loss="mse")
