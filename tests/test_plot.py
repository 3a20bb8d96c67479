"""mf.utils.plot_history: a PNG with one panel per metric, training and validation per epoch."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf
from meshfit.utils._plot import draw_history

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _history():
    (x, y), (xv, yv) = mf.datasets.load_digits()
    torch.manual_seed(0)
    model = mf.Model(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)))
    model.compile(mf.optimizers.SGD(learning_rate=0.05), mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model.fit(x[:256], y[:256], validation_data=(xv[:64], yv[:64]), batch_size=64, epochs=3, verbose=0)


def test_plot_history_writes_a_png_of_every_metric_with_validation(tmp_path):
    history = _history()
    path = mf.utils.plot_history(history, tmp_path / "plots" / "training.png", title="digits")
    assert path == str(tmp_path / "plots" / "training.png")
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.shape[0] == 360 and image.shape[1] == 960  # two panels side by side, 4.8 x 3.6 in each
    assert image[..., :3].std() > 0.05  # not blank
    # No global pyplot state, no display: checked in a fresh process (another test may import pyplot).
    code = ("import sys, meshfit as mf; h = {'loss': [1.0, 0.5], 'val_loss': [1.2, 0.7]}; "
            f"mf.utils.plot_history(h, {str(tmp_path / 'fresh.png')!r}); print('matplotlib.pyplot' in sys.modules)")
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": ROOT})
    assert fresh.returncode == 0 and fresh.stdout.strip() == "False", fresh.stderr

    figure = draw_history(history)
    axes = figure.get_axes()
    assert [a.get_title() for a in axes] == ["loss", "accuracy"]
    for axis, name in zip(axes, ["loss", "accuracy"], strict=True):
        training, validation = axis.get_lines()
        assert list(training.get_xdata()) == [1, 2, 3]
        np.testing.assert_allclose(training.get_ydata(), history.history[name])
        np.testing.assert_allclose(validation.get_ydata(), history.history[f"val_{name}"])
        assert [t.get_text() for t in axis.get_legend().get_texts()] == ["training", "validation"]


def test_plot_history_accepts_a_dict_and_rejects_bad_input(tmp_path):
    figure = draw_history({"loss": [1.0, 0.5, 0.25], "learning_rate": [0.1, 0.1, 0.01]})
    assert [a.get_title() for a in figure.get_axes()] == ["loss", "learning_rate"]
    assert [len(a.get_lines()) for a in figure.get_axes()] == [1, 1]
    with pytest.raises(ValueError, match="Invalid `history`"):
        mf.utils.plot_history({}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="one value per epoch"):
        mf.utils.plot_history({"loss": [1.0], "val_loss": [1.0, 2.0]}, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
