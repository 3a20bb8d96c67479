"""``compile(jit_compile=...)``: Keras's values, decided per device; never a slower step than eager.

On CPU, ``jit_compile=True`` runs the step eagerly with one warning (compiling measured slower there:
bench/bench_jit.py); ``MESHFIT_JIT_COMPILE_ON_CPU=1`` compiles anyway. ``"auto"`` (Keras 3's
default) is eager, silently.
"""

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf


def _model() -> mf.Model:
    torch.manual_seed(0)
    return mf.Model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))


def _fit(model: mf.Model) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype("float32"), rng.normal(size=(64, 2)).astype("float32")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()


def test_jit_compile_true_on_cpu_runs_eagerly_and_says_so_once(monkeypatch):
    monkeypatch.delenv("MESHFIT_JIT_COMPILE_ON_CPU", raising=False)
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile("sgd", "mse", jit_compile=True)
        _fit(model)
    messages = [str(w.message) for w in caught if "jit_compile" in str(w.message)]
    assert len(messages) == 1
    assert "CPU" in messages[0] and "eagerly" in messages[0] and "MESHFIT_JIT_COMPILE_ON_CPU" in messages[0]
    assert model.jit_compile is False
    assert not isinstance(model.placement.module, torch._dynamo.eval_frame.OptimizedModule)


def test_jit_compile_defaults_to_auto_which_is_eager_without_a_warning():
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.compile("sgd", "mse")
        model.compile("sgd", "mse", jit_compile="auto")
        _fit(model)
    assert model.jit_compile is False
    assert not isinstance(model.placement.module, torch._dynamo.eval_frame.OptimizedModule)


@pytest.mark.slow  # starts processes
def test_jit_compile_on_cpu_when_asked_compiles_and_trains_to_the_eager_weights(monkeypatch):
    eager = _model()
    eager.compile("sgd", "mse", jit_compile=False)
    expected = _fit(eager)
    monkeypatch.setenv("MESHFIT_JIT_COMPILE_ON_CPU", "1")
    jitted = _model()
    jitted.compile("sgd", "mse", jit_compile=True)
    weights = _fit(jitted)
    assert jitted.jit_compile is True
    assert isinstance(jitted.placement.module, torch._dynamo.eval_frame.OptimizedModule)
    for a, b in zip(expected, weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_jit_compile_rejects_other_values_naming_them(value):
    with pytest.raises(TypeError, match=r"Invalid `jit_compile`: expected True, False or 'auto', received jit_compile="):
        _model().compile("sgd", "mse", jit_compile=value)


def test_a_module_torch_cannot_compile_is_named_with_how_to_train_it_eagerly(monkeypatch):
    # torch.compile fails at the first step (here its backend refuses the graph): fit says which module,
    # torch's reason and the eager spelling; it does not fall back to eager where compiling was asked for.
    import functools

    def refusing_backend(graph, example_inputs):
        raise NotImplementedError("no kernel for this graph on this device")

    monkeypatch.setenv("MESHFIT_JIT_COMPILE_ON_CPU", "1")
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=refusing_backend))
    torch._dynamo.reset()
    model = _model()
    model.compile("sgd", "mse", jit_compile=True)
    with pytest.raises(RuntimeError, match=r"jit_compile=True: torch.compile could not compile Sequential "
                                           r"\(BackendCompilerFailed: .*no kernel for this graph.*jit_compile=False"):
        _fit(model)
    torch._dynamo.reset()
    eager = _model()
    eager.compile("sgd", "mse", jit_compile=False)
    assert len(_fit(eager)) == 4  # the same model trains eagerly


def test_an_error_of_the_models_inputs_under_jit_compile_is_torchs_own():
    # A shape mismatch fails eagerly too: it is not reported as a compile failure.
    from meshfit.distribute._plan_builder import compiled

    torch._dynamo.reset()
    module = compiled(nn.Linear(4, 2), True)
    module(torch.randn(3, 4))
    with pytest.raises(RuntimeError) as info:
        module(torch.randn(3, 5))
    assert "could not compile" not in str(info.value) and "jit_compile=False" not in str(info.value)
    torch._dynamo.reset()
