"""What a new user meets first: the command's version, input errors, the docs and the image."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from torch import nn

import meshfit as mf
from meshfit._cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_meshfit_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"meshfit {mf.__version__}"
    assert main(["-V"]) == 0
    assert mf.__version__ in capsys.readouterr().out


def test_length_mismatch_names_x_and_y():
    model = mf.Model(nn.Linear(3, 1))
    model.compile("sgd", "mse")
    x, y = np.zeros((20, 3), "float32"), np.zeros((10, 1), "float32")
    with pytest.raises(ValueError, match=r"same number of samples.*x: \[20\], y: \[10\]"):
        model.fit(x, y, verbose=0)


def test_internals_links_stay_inside_the_repository():
    with open(os.path.join(ROOT, "docs", "INTERNALS.md")) as f:
        text = f.read()
    targets = re.findall(r"\]\(([^)]+)\)", text) + re.findall(r"`([^`\s]*/[^`\s]*\.\w+)`", text)
    for target in targets:
        if target.startswith(("http://", "https://", "#")):
            continue
        resolved = os.path.normpath(os.path.join(ROOT, "docs", target))
        inside = os.path.normpath(os.path.join(ROOT, target))
        assert not target.startswith(("../", "/")) or resolved.startswith(ROOT + os.sep), target
        assert os.path.commonpath([ROOT, inside]) == ROOT, target


def test_dockerfile_takes_torch_from_the_cpu_index():
    with open(os.path.join(ROOT, "deploy", "Dockerfile")) as f:
        text = f.read()
    assert "download.pytorch.org/whl/cpu" in text
    torch_step = text.index("--index-url")
    assert torch_step < text.index("pip install --no-cache-dir .")  # torch first: `.` then finds it installed
