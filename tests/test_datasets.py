"""Tests for meshfit.datasets: load_digits (sklearn's bundled digits) and load_mnist (local npz)."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
import torch
from torch import nn

from meshfit.datasets import load_digits, load_mnist


def test_load_digits_shapes_dtypes_and_range():
    (x_train, y_train), (x_test, y_test) = load_digits()
    assert x_train.shape[1:] == (8, 8) and x_test.shape[1:] == (8, 8)
    assert len(x_train) + len(x_test) == 1797
    assert len(x_train) == len(y_train) and len(x_test) == len(y_test)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int64
    assert x_train.min() == 0.0 and x_train.max() == 1.0
    assert set(np.unique(y_test)) == set(range(10))


def test_load_digits_split_is_stratified_and_deterministic():
    (x_a, y_a), (_, y_test) = load_digits(test_fraction=0.25, seed=3)
    (x_b, y_b), _ = load_digits(test_fraction=0.25, seed=3)
    (x_c, _), _ = load_digits(test_fraction=0.25, seed=4)
    np.testing.assert_array_equal(x_a, x_b)
    np.testing.assert_array_equal(y_a, y_b)
    assert not np.array_equal(x_a, x_c)
    all_counts = np.bincount(np.concatenate([y_a, y_test]), minlength=10)
    test_counts = np.bincount(y_test, minlength=10)
    assert np.all(np.abs(test_counts - 0.25 * all_counts) <= 1)
    assert len(y_test) == pytest.approx(0.25 * 1797, abs=10)
    assert not np.all(np.diff(y_a) >= 0)  # shuffled, not grouped by class


def test_load_digits_28_is_framed_like_mnist_and_feeds_the_seed_cnn():
    (x_train, y_train), (x_test, _) = load_digits(image_size=28)
    assert x_train.shape[1:] == (28, 28) and x_test.shape[1:] == (28, 28)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int64
    assert x_train.min() >= 0.0 and x_train.max() <= 1.0
    border = np.ones((28, 28), dtype=bool)
    border[4:24, 4:24] = False
    assert np.all(x_train[:, border] == 0.0)
    assert x_train[:, 4:24, 4:24].max() > 0.9
    model = nn.Sequential(
        nn.Unflatten(1, (1, 28)), nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(128), nn.ReLU(),
        nn.Linear(128, 10),
    )  # fmt: skip
    assert model(torch.from_numpy(x_train[:4])).shape == (4, 10)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"image_size": 4}, ValueError),
        ({"image_size": "28"}, TypeError),
        ({"image_size": True}, TypeError),
        ({"test_fraction": 0.0}, ValueError),
        ({"test_fraction": 1.5}, ValueError),
        ({"test_fraction": "0.2"}, TypeError),
        ({"test_fraction": 0.0001}, ValueError),
        ({"seed": -1}, ValueError),
    ],
)
def test_load_digits_rejects_bad_arguments(kwargs, error):
    name, value = next(iter(kwargs.items()))
    with pytest.raises(error, match=name):
        load_digits(**kwargs)


def _write_mnist(path, **overrides):
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.integers(0, 256, size=(6, 28, 28), dtype=np.uint8),
        "y_train": rng.integers(0, 10, size=6, dtype=np.uint8),
        "x_test": rng.integers(0, 256, size=(3, 28, 28), dtype=np.uint8),
        "y_test": rng.integers(0, 10, size=3, dtype=np.uint8),
    }
    arrays.update(overrides)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return arrays


def test_load_mnist_returns_arrays_as_stored(tmp_path):
    arrays = _write_mnist(tmp_path / "mnist.npz")
    for path in (tmp_path / "mnist.npz", str(tmp_path / "mnist.npz"), tmp_path):
        (x_train, y_train), (x_test, y_test) = load_mnist(path)
        for name, got in zip(("x_train", "y_train", "x_test", "y_test"), (x_train, y_train, x_test, y_test), strict=True):
            assert got.dtype == np.uint8
            np.testing.assert_array_equal(got, arrays[name])


def test_load_mnist_missing_file_says_to_download(tmp_path):
    path = tmp_path / "nowhere" / "mnist.npz"
    with pytest.raises(FileNotFoundError, match="download") as info:
        load_mnist(path)
    assert str(path) in str(info.value)


def test_load_mnist_missing_key(tmp_path):
    _write_mnist(tmp_path / "mnist.npz", y_test=None)
    with pytest.raises(ValueError, match="y_test"):
        load_mnist(tmp_path / "mnist.npz")


def test_load_mnist_wrong_shapes(tmp_path):
    _write_mnist(tmp_path / "a.npz", x_train=np.zeros((6, 28, 27), np.uint8))
    with pytest.raises(ValueError, match=r"x_train.*\(6, 28, 27\)"):
        load_mnist(tmp_path / "a.npz")
    _write_mnist(tmp_path / "b.npz", y_test=np.zeros(4, np.uint8))
    with pytest.raises(ValueError, match="y_test"):
        load_mnist(tmp_path / "b.npz")


def test_load_mnist_unreadable_or_pickled_file(tmp_path):
    (tmp_path / "junk.npz").write_bytes(b"not a zip file at all")
    with pytest.raises(ValueError, match="junk.npz"):
        load_mnist(tmp_path / "junk.npz")
    np.savez(tmp_path / "obj.npz", x_train=np.array([{"a": 1}], dtype=object), y_train=np.zeros(1),
             x_test=np.zeros((1, 28, 28)), y_test=np.zeros(1))  # fmt: skip
    with pytest.raises(ValueError, match="obj.npz"):
        load_mnist(tmp_path / "obj.npz")


def test_load_digits_matches_sklearn():
    env = dict(os.environ)
    try:
        from sklearn.datasets import load_digits as sklearn_load_digits

        bunch = sklearn_load_digits()
    finally:  # importing sklearn sets KMP_* variables; the leak guard would flag them
        os.environ.clear()
        os.environ.update(env)
    (x_train, y_train), (x_test, y_test) = load_digits()
    x = np.concatenate([x_train, x_test]).reshape(len(bunch.target), -1)
    y = np.concatenate([y_train, y_test])
    expected = Counter((tuple(row), label) for row, label in zip(bunch.data / 16.0, bunch.target, strict=True))
    assert Counter((tuple(row), label) for row, label in zip(x.astype(np.float64), y, strict=True)) == expected
