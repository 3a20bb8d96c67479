"""fit on one GPU: equal to the CPU run, no host sync in the step, fp16 with loss scaling, bf16."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _gpu import MARKS, compiled_model, data, mlp
from torch import nn

import meshfit as mf
from meshfit import mixed_precision
from meshfit._engine._state import RandomState

pytestmark = MARKS


@pytest.fixture(autouse=True)
def _reset_policy():
    yield
    mixed_precision.set_global_policy(None)


def _fit(device: str, epochs: int = 2, callbacks: list = (), **compile_args):
    strategy = mf.OneDeviceStrategy(device)
    with strategy.scope():
        model = compiled_model(**compile_args)
    history = model.fit(*data(), batch_size=32, epochs=epochs, verbose=0, shuffle=False, callbacks=list(callbacks))
    return model, history.history


def test_one_device_strategy_on_cuda0_equals_the_cpu_run():
    gpu, gpu_history = _fit("cuda:0")
    cpu, cpu_history = _fit("cpu")
    assert mf.OneDeviceStrategy("cuda:0").device == torch.device("cuda", 0)
    assert {p.device.type for p in gpu.module.parameters()} == {"cuda"}
    for a, b in zip(gpu.get_weights(), cpu.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gpu_history["loss"], cpu_history["loss"], rtol=1e-4)
    np.testing.assert_allclose(gpu_history["accuracy"], cpu_history["accuracy"], atol=1e-6)


class _SyncsAreErrors(mf.callbacks.Callback):
    """CUDA's sync debug mode set to "error" from each batch's begin to its end: the step itself."""

    reads_batch_logs = False

    def on_train_batch_begin(self, batch, logs=None):
        torch.cuda.set_sync_debug_mode("error")

    def on_train_batch_end(self, batch, logs=None):
        torch.cuda.set_sync_debug_mode("default")


def test_a_step_without_log_readers_never_waits_for_the_gpu():
    try:
        model, history = _fit("cuda:0", callbacks=[_SyncsAreErrors()])  # a synchronising call raises
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(history["loss"]) == 2 and np.isfinite(history["loss"]).all()
    assert all(t.device.type == "cuda" for t in model.metrics[0].state_tensors())


@pytest.mark.parametrize("policy, dtype", [("mixed_float16", torch.float16), ("mixed_bfloat16", torch.bfloat16)])
def test_mixed_precision_fit(policy, dtype):
    mixed_precision.set_global_policy(policy)
    seen = []
    strategy = mf.OneDeviceStrategy("cuda:0")
    with strategy.scope():
        model = compiled_model()
    model.module[2].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    history = model.fit(*data(), batch_size=32, epochs=3, verbose=0, shuffle=False)
    assert set(seen) == {dtype}
    assert all(p.dtype == torch.float32 for p in model.module.parameters())  # master weights
    assert isinstance(model.optimizer, mixed_precision.LossScaleOptimizer) == (policy == "mixed_float16")
    assert history.history["loss"][-1] < history.history["loss"][0]
    _, reference = _fit("cuda:0", epochs=3)
    np.testing.assert_allclose(history.history["loss"], reference["loss"], rtol=5e-2)


def test_loss_scaling_on_the_gpu_skips_an_inf_step():
    mixed_precision.set_global_policy("mixed_float16")
    module = mlp()
    calls = []
    module[0].weight.register_hook(lambda g: (calls.append(1), g * float("inf") if len(calls) == 2 else g)[1])
    strategy = mf.OneDeviceStrategy("cuda:0")
    with strategy.scope():
        model = compiled_model(module)
    model.fit(*data(), batch_size=32, epochs=1, verbose=0, shuffle=False)
    assert model.optimizer.iterations == 7  # 8 steps, the second skipped
    assert float(model.optimizer.dynamic_scale) == 2.0**14
    assert model.optimizer.dynamic_scale.device.type == "cuda"


def test_a_gpu_replica_saves_its_cuda_rng_stream():
    rng = RandomState(torch.device("cuda", 0))
    state = rng.state_dict()
    expected = torch.rand(8, device="cuda:0")
    torch.rand(3, device="cuda:0")
    rng.load_state_dict(state)
    assert torch.equal(torch.rand(8, device="cuda:0"), expected)


def test_cpu_batches_reach_the_gpu_from_pinned_memory():
    strategy = mf.OneDeviceStrategy("cuda:0")
    copies = []
    original = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        copies.append((self.is_pinned(), kwargs.get("non_blocking", False)))
        return original(self, *args, **kwargs)

    torch.Tensor.to = recording_to
    try:
        placed = strategy.distribute_batch((torch.ones(4, 8), torch.zeros(4, dtype=torch.int64)))
    finally:
        torch.Tensor.to = original
    assert all(t.device.type == "cuda" for t in placed)
    assert (True, True) in copies and all(pinned for pinned, _ in copies if _)


def test_a_layer_placed_by_hand_with_nn_module_to_still_trains():
    module = nn.Sequential(nn.Linear(8, 4)).to("cuda:0")
    model = mf.Model(module)
    model.compile("adam", mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(*data(), batch_size=64, epochs=1, verbose=0)
    assert next(module.parameters()).device.type == "cuda"


def _compiled_or_eager(device: str, jit: bool, accumulation: int | None) -> tuple[list[np.ndarray], list[float]]:
    strategy = mf.OneDeviceStrategy(device)
    with strategy.scope():
        model = mf.Model(mlp())
        model.compile(mf.optimizers.SGD(learning_rate=0.1, momentum=0.9, gradient_accumulation_steps=accumulation),
                      mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"], jit_compile=jit)
    history = model.fit(*data(), batch_size=32, epochs=2, verbose=0, shuffle=False)
    if jit:
        assert isinstance(model.placement.module, torch._dynamo.eval_frame.OptimizedModule)
    return model.get_weights(), history.history["loss"]


@pytest.mark.parametrize("accumulation", [None, 2], ids=["each-step", "accumulating-2"])
def test_a_compiled_step_on_the_gpu_trains_to_the_eager_weights(accumulation):
    """``jit_compile=True`` on ``cuda:0`` (the module through torch.compile) ends on the weights and losses of the
    eager step, also where gradients accumulate over two batches (compiled CUDA graphs have summed accumulated
    gradients wrongly: pytorch/pytorch#96693)."""
    eager, eager_loss = _compiled_or_eager("cuda:0", False, accumulation)
    compiled, compiled_loss = _compiled_or_eager("cuda:0", True, accumulation)
    for a, b in zip(compiled, eager, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(compiled_loss, eager_loss, rtol=1e-4)
