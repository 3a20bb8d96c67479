"""Denormals flush to zero inside training, evaluation, prediction and ``strategy.run`` (as TensorFlow
does on its threads), on every intra-op thread, and the previous state comes back after."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf
from meshfit._runtime import FLUSH_DENORMALS_ENV, flush_denormals, flushing_denormals

# 1e-20 squared is 1e-40, a float32 denormal: 0 when flushed. Big enough that torch splits the
# multiply over its intra-op threads, so each thread's own setting shows in its share of the result.
_BIG = torch.full((4_000_000,), 1e-20)


def denormal_products() -> int:
    """How many of the elementwise products stayed denormal (0 when every thread flushes)."""
    return int((_BIG * _BIG != 0).sum())


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    _not_flushing_anywhere()
    yield
    _not_flushing_anywhere()
    torch.set_num_threads(threads)


def _not_flushing_anywhere():
    """No thread of the 2-thread team flushes: a test that set the calling thread's flag and ran a
    region (which restores that flag on the whole team) leaves nothing for the next test, in any order."""
    torch.set_flush_denormal(False)
    with flush_denormals():
        pass
    assert denormal_products() == _BIG.numel()


class Probe(mf.callbacks.Callback):
    """Records, at each hook, whether the calling thread flushes and how many products stayed denormal."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def _record(self, *_args, **_kwargs):
        self.seen.append((flushing_denormals(), denormal_products()))

    on_train_batch_end = on_test_batch_end = on_predict_batch_end = _record


def _model():
    torch.manual_seed(0)
    model = mf.Model(nn.Sequential(nn.Linear(4, 3)))
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 4)).astype("float32"), rng.integers(0, 3, size=16)


def test_not_flushing_at_import_in_a_fresh_process():
    code = ("import torch, meshfit; meshfit.Model; from meshfit._runtime import flushing_denormals; "
            "print(flushing_denormals())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_a_parallel_op_shows_each_threads_setting(two_threads):
    """The check the tests below rely on: set_flush_denormal alone covers the calling thread only."""
    assert denormal_products() == _BIG.numel()
    torch.set_flush_denormal(True)
    assert 0 < denormal_products() < _BIG.numel()  # the pool thread's half still denormal


@pytest.mark.parametrize("method", ["fit", "evaluate", "predict"])
def test_flushed_on_every_thread_inside_and_restored_after(two_threads, method):
    model, (x, y), probe = _model(), _data(), Probe()
    if method == "predict":
        model.predict(x, batch_size=8, verbose=0, callbacks=[probe])
    else:
        getattr(model, method)(x, y, batch_size=8, verbose=0, callbacks=[probe])
    assert probe.seen and all(seen == (True, 0) for seen in probe.seen), probe.seen
    assert not flushing_denormals()
    assert denormal_products() == _BIG.numel()  # the pool threads are back too


def test_restored_after_an_error_and_a_previous_setting_kept(two_threads):
    model, (x, y) = _model(), _data()

    class Boom(mf.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[Boom()])
    assert denormal_products() == _BIG.numel()
    torch.set_flush_denormal(True)
    model.fit(x, y, batch_size=8, verbose=0)
    assert flushing_denormals()  # a user's own setting survives fit


def test_strategy_run_flushes_inside(two_threads):
    strategy = mf.OneDeviceStrategy("cpu")
    seen = strategy.run(lambda: (flushing_denormals(), denormal_products()))
    assert seen == (True, 0)
    assert not flushing_denormals()
    assert denormal_products() == _BIG.numel()


def test_opt_out_by_environment(two_threads, monkeypatch):
    monkeypatch.setenv(FLUSH_DENORMALS_ENV, "0")
    model, (x, y), probe = _model(), _data(), Probe()
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[probe])
    assert probe.seen and all(seen == (False, _BIG.numel()) for seen in probe.seen)



def test_restored_on_the_whole_team_when_the_thread_count_dropped_inside(two_threads):
    """A region that lowers torch's thread count (a strategy sharing the cores) still restores every
    thread of the team it flushed: libgomp keeps those threads for the next, larger team."""
    with flush_denormals():
        torch.set_num_threads(1)
    torch.set_num_threads(2)
    assert not flushing_denormals()
    assert denormal_products() == _BIG.numel()
