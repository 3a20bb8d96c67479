"""mf.mixed_precision.LossScaleOptimizer: Keras's dynamic loss scaling, applied by fit under mixed_float16.

On the CPU (float16 autocast runs there too): an injected inf gradient skips the step and halves the
scale; ``dynamic_growth_steps`` finite steps double it; the scale is part of a backup (bitwise resume).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf
from meshfit import mixed_precision

LSO = mixed_precision.LossScaleOptimizer


@pytest.fixture(autouse=True)
def _reset_policy():
    yield
    mixed_precision.set_global_policy(None)


def _param_and_optimizer(**kwargs):
    param = nn.Parameter(torch.tensor([1.0, -2.0]))
    optimizer = LSO(mf.optimizers.SGD(learning_rate=0.5), **kwargs)
    optimizer.build([param])
    return param, optimizer


def _step(param, optimizer, gradient):
    optimizer.zero_grad()
    optimizer.scale_loss((param * torch.as_tensor(gradient)).sum()).backward()
    optimizer.step()


def test_defaults_are_keras():
    optimizer = LSO(mf.optimizers.SGD())
    assert optimizer.initial_scale == 2.0**15 and optimizer.dynamic_growth_steps == 2000
    assert float(optimizer.dynamic_scale) == 2.0**15
    assert float(optimizer.scale_loss(torch.tensor(2.0))) == 2.0**16


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"initial_scale=0"):
        LSO("sgd", initial_scale=0)
    with pytest.raises(ValueError, match=r"dynamic_growth_steps=1.5"):
        LSO("sgd", dynamic_growth_steps=1.5)
    with pytest.raises(ValueError, match=r"dynamic=False"):
        LSO("sgd", dynamic=False)
    with pytest.raises(ValueError, match=r"`clipnorm`.*inner optimizer"):
        LSO("sgd", clipnorm=1.0)
    with pytest.raises(ValueError, match=r"LossScaleOptimizer"):
        LSO(LSO("sgd"))


def test_the_update_is_the_unscaled_optimizers_bitwise():
    param, optimizer = _param_and_optimizer()
    plain = nn.Parameter(torch.tensor([1.0, -2.0]))
    reference = mf.optimizers.SGD(learning_rate=0.5)
    reference.build([plain])
    for gradient in ([0.25, 3.0], [-1.5, 0.125]):
        _step(param, optimizer, gradient)
        reference.zero_grad()
        (plain * torch.tensor(gradient)).sum().backward()
        reference.step()
    assert torch.equal(param.detach(), plain.detach())
    assert optimizer.iterations == 2


def test_an_inf_gradient_skips_the_step_and_halves_the_scale():
    param, optimizer = _param_and_optimizer(initial_scale=1024.0, dynamic_growth_steps=100)
    _step(param, optimizer, [1.0, 1.0])
    before = param.detach().clone()
    _step(param, optimizer, [float("inf"), 1.0])
    assert torch.equal(param.detach(), before)  # skipped: no part of the update applied
    assert float(optimizer.dynamic_scale) == 512.0 and int(optimizer.step_counter) == 0
    assert optimizer.iterations == 1  # a skipped step is not counted, as in Keras
    _step(param, optimizer, [float("nan"), 1.0])
    assert float(optimizer.dynamic_scale) == 256.0


def test_the_scale_doubles_after_dynamic_growth_steps_finite_steps():
    param, optimizer = _param_and_optimizer(initial_scale=4.0, dynamic_growth_steps=3)
    for expected_counter in (1, 2):
        _step(param, optimizer, [1.0, 1.0])
        assert float(optimizer.dynamic_scale) == 4.0 and int(optimizer.step_counter) == expected_counter
    _step(param, optimizer, [1.0, 1.0])
    assert float(optimizer.dynamic_scale) == 8.0 and int(optimizer.step_counter) == 0


def test_keras_2_loop_unscales_explicitly_and_apply_gradients_does_not_again():
    param, optimizer = _param_and_optimizer(initial_scale=64.0)
    loss = optimizer.get_scaled_loss((param * torch.tensor([0.5, 2.0])).sum())
    (scaled,) = torch.autograd.grad(loss, [param])
    (unscaled,) = optimizer.get_unscaled_gradients([scaled])
    assert torch.equal(unscaled, torch.tensor([0.5, 2.0]))
    optimizer.apply_gradients([(unscaled, param)])
    assert torch.equal(param.detach(), torch.tensor([1.0 - 0.25, -2.0 - 1.0]))
    assert callable(optimizer.get_scaled_loss(lambda: torch.tensor(1.0)))


def test_scale_and_counter_are_in_the_state_dict_and_resume_bitwise():
    param, optimizer = _param_and_optimizer(initial_scale=8.0, dynamic_growth_steps=2)
    _step(param, optimizer, [float("inf"), 1.0])
    _step(param, optimizer, [1.0, 3.0])
    state = optimizer.state_dict()
    assert float(state["loss_scale"]["scale"]) == 4.0 and int(state["loss_scale"]["step_counter"]) == 1
    resumed_param, resumed = _param_and_optimizer(initial_scale=8.0, dynamic_growth_steps=2)
    resumed_param.data.copy_(param.detach())
    resumed.load_state_dict(state)
    for p, o in ((param, optimizer), (resumed_param, resumed)):
        _step(p, o, [0.5, 0.5])
    assert float(resumed.dynamic_scale) == float(optimizer.dynamic_scale) == 8.0  # grown at the same step
    assert torch.equal(resumed_param.detach(), param.detach()) and resumed.iterations == optimizer.iterations


class _InfOnce(nn.Module):
    """A small classifier whose first layer's gradient is inf on the `at`-th backward."""

    def __init__(self, at: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        self.backwards = 0
        self.body[0].weight.register_hook(self._maybe_inf)
        self.at = at

    def _maybe_inf(self, grad):
        self.backwards += 1
        return torch.full_like(grad, float("inf")) if self.backwards == self.at else grad

    def forward(self, x):
        return self.body(x)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    return x, (x[:, 0] > 0).astype("int64")


def test_fit_under_mixed_float16_scales_the_loss_in_float16_and_skips_an_inf_step():
    mixed_precision.set_global_policy("mixed_float16")
    module = _InfOnce(at=3)
    model = mf.Model(module)
    model.compile(mf.optimizers.SGD(learning_rate=0.1), mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert isinstance(model.optimizer, LSO)  # Keras's auto_scale_loss
    seen = []
    module.body[2].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    history = model.fit(*_data(), batch_size=16, epochs=2, verbose=0)
    assert set(seen) == {torch.float16}
    assert model.optimizer.iterations == 7  # 8 steps, the third skipped
    assert float(model.optimizer.dynamic_scale) == 2.0**14 and int(model.optimizer.step_counter) == 5
    assert all(np.isfinite(history.history["loss"]))
    assert all(p.dtype == torch.float32 for p in module.parameters())  # master weights


def test_auto_scale_loss_false_and_other_policies_keep_the_optimizer():
    mixed_precision.set_global_policy("mixed_float16")
    model = mf.Model(nn.Linear(2, 2))
    model.compile("sgd", "mse", auto_scale_loss=False)
    assert not isinstance(model.optimizer, LSO)
    mixed_precision.set_global_policy("mixed_bfloat16")
    model.compile("sgd", "mse")
    assert not isinstance(model.optimizer, LSO)


def test_a_backup_under_mixed_float16_resumes_bitwise_with_the_scale(tmp_path):
    mixed_precision.set_global_policy("mixed_float16")

    def run(callbacks, epochs, inf_at=2):
        model = mf.Model(_InfOnce(at=inf_at))
        model.compile(LSO(mf.optimizers.SGD(learning_rate=0.1), initial_scale=256.0, dynamic_growth_steps=3),
                      mf.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(*_data(), batch_size=16, epochs=epochs, verbose=0, shuffle=False, callbacks=callbacks)
        return model

    reference = run([], epochs=3)
    backup = str(tmp_path / "backup")
    run([mf.callbacks.BackupAndRestore(backup, delete_checkpoint=False)], epochs=2)
    # The inf gradient (step 2, before the backup) is not injected again after the restart.
    resumed = run([mf.callbacks.BackupAndRestore(backup)], epochs=3, inf_at=0)
    assert float(resumed.optimizer.dynamic_scale) == float(reference.optimizer.dynamic_scale) == 1024.0
    assert int(resumed.optimizer.step_counter) == int(reference.optimizer.step_counter)
    for a, b in zip(resumed.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def _two_workers_one_inf(rank: int, world: int):
    mixed_precision.set_global_policy("mixed_float16")
    strategy = mf.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = mf.Model(_InfOnce(at=2 if rank == 0 else 0))  # only rank 0's gradient is inf, once
        model.compile(mf.optimizers.SGD(learning_rate=0.1), mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(*_data(), batch_size=16, epochs=1, verbose=0)
    return model.optimizer.iterations, float(model.optimizer.dynamic_scale), model.get_weights()


def test_an_inf_on_one_worker_skips_the_step_on_every_worker():
    from _multiproc import run_distributed

    (it0, scale0, w0), (it1, scale1, w1) = run_distributed(_two_workers_one_inf, world_size=2, timeout=180)
    assert (it0, scale0) == (it1, scale1) == (3, 2.0**14)  # 4 steps, the second skipped everywhere
    for a, b in zip(w0, w1, strict=True):
        np.testing.assert_array_equal(a, b)
