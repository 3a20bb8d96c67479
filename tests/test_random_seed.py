"""mf.utils.set_random_seed: Python's `random`, NumPy and torch seeded at once, as keras.utils.set_random_seed."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf


def _draws() -> tuple[float, float, torch.Tensor, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(3), nn.Linear(4, 2).weight.detach().clone()


def test_one_call_seeds_python_numpy_and_torch():
    mf.utils.set_random_seed(1337)
    first = _draws()
    random.seed(0)  # move every stream away
    np.random.seed(0)
    torch.manual_seed(0)
    _draws()
    mf.utils.set_random_seed(1337)
    second = _draws()
    assert first[:2] == second[:2]
    assert torch.equal(first[2], second[2]) and torch.equal(first[3], second[3])
    assert torch.initial_seed() == 1337
    mf.utils.set_random_seed(1338)
    assert _draws()[0] != first[0]


def test_it_is_exported_from_meshfit_utils():
    assert "set_random_seed" in mf.utils.__all__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_generators_are_seeded():
    mf.utils.set_random_seed(7)
    first = torch.rand(3, device="cuda")
    mf.utils.set_random_seed(7)
    assert torch.equal(first, torch.rand(3, device="cuda"))


@pytest.mark.parametrize("seed", ["1337", 1.5, None, True, np.float32(3.0)])
def test_a_seed_that_is_not_an_int_is_a_clear_value_error(seed):
    with pytest.raises(ValueError, match=r"Invalid `seed`: expected `seed` argument to be an integer, received seed="):
        mf.utils.set_random_seed(seed)


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_outside_numpys_range_is_a_clear_value_error(seed):
    with pytest.raises(ValueError, match=rf"received seed={seed}\."):
        mf.utils.set_random_seed(seed)
