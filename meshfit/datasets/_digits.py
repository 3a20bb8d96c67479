"""`load_digits`: scikit-learn's bundled 8x8 handwritten digits, no download needed."""

from __future__ import annotations

import importlib.util
import numbers
import os

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["load_digits"]

_Split = tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def _read_sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 8x8 images (0..16) and labels that ``sklearn.datasets.load_digits`` returns.

    The CSV bundled with scikit-learn is read directly: importing ``sklearn`` sets environment
    variables (``KMP_DUPLICATE_LIB_OK``, ``KMP_INIT_AT_FORK``) and is slow; the API is the fallback.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise ImportError("load_digits needs scikit-learn, which ships the data: pip install scikit-learn.")
    csv = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz")
    if os.path.isfile(csv):
        data = np.loadtxt(csv, delimiter=",", dtype=np.float32)
        return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as sklearn_load_digits

    bunch = sklearn_load_digits()
    return np.asarray(bunch.images, dtype=np.float32), np.asarray(bunch.target, dtype=np.int64)


def _check_args(image_size: object, test_fraction: object, seed: object) -> None:
    """Raises TypeError/ValueError for invalid `load_digits` arguments."""
    if isinstance(image_size, bool) or not isinstance(image_size, numbers.Integral):
        raise TypeError(
            f"Invalid `image_size`: expected an int (8 for the raw images, 28 for MNIST-like ones), "
            f"received image_size={image_size!r}."
        )
    if image_size < 8:
        raise ValueError(
            f"Invalid `image_size`: expected an int >= 8 (8 or 28 are typical), received image_size={image_size}."
        )
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, numbers.Real):
        raise TypeError(
            f"Invalid `test_fraction`: expected a float in (0, 1), received test_fraction={test_fraction!r}."
        )
    if not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(
            f"Invalid `test_fraction`: expected a float in (0, 1), received test_fraction={test_fraction}."
        )
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"Invalid `seed`: expected a non-negative int, received seed={seed!r}.")


def _frame(images: np.ndarray, image_size: int) -> np.ndarray:
    """Resizes 8x8 digits into a centred box filling 20/28 of an ``image_size`` frame (MNIST's framing)."""
    inner = max(8, round(image_size * 20 / 28))
    pad_before = (image_size - inner) // 2
    pad_after = image_size - inner - pad_before
    x = torch.from_numpy(images).unsqueeze(1)
    x = F.interpolate(x, size=(inner, inner), mode="bilinear", align_corners=False)
    x = F.pad(x, (pad_before, pad_after, pad_before, pad_after))
    return x.squeeze(1).clamp_(0.0, 1.0).numpy()


def _stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Shuffled train and test indices holding ``test_fraction`` of every class in the test part."""
    order = np.random.default_rng(seed).permutation(len(labels))
    in_test = np.zeros(len(labels), dtype=bool)
    for label in np.unique(labels):
        positions = np.flatnonzero(labels[order] == label)
        in_test[positions[: round(len(positions) * test_fraction)]] = True
    train, test = order[~in_test], order[in_test]
    if len(train) == 0 or len(test) == 0:
        raise ValueError(
            f"Invalid `test_fraction`: test_fraction={test_fraction} leaves {len(train)} training and "
            f"{len(test)} test examples; choose a value that keeps both non-empty, e.g. 0.2."
        )
    return train, test


def load_digits(image_size: int = 8, test_fraction: float = 0.2, seed: int = 0) -> _Split:
    """Loads scikit-learn's 1,797 8x8 handwritten digits, split into train and test sets.

    These are the images of ``sklearn.datasets.load_digits``; the data ships with scikit-learn, so
    nothing is downloaded. Pixels are scaled from 0..16 to
    [0, 1]. With ``image_size=8`` the images are returned as they are. With a larger size (28 gives
    MNIST's shape, so a model written for MNIST runs unchanged) each digit is resized bilinearly to
    ``round(image_size * 20 / 28)`` pixels square (20x20 for 28) and centred on a zero background,
    as MNIST frames its 20x20 digits in 28x28 images (4 pixels of padding on each side).

    The split is stratified (each class contributes ``test_fraction`` of its examples to the test
    set) and both parts are shuffled; the same ``seed`` always gives the same split.

    Args:
        image_size: Side of the returned square images, at least 8.
        test_fraction: Fraction of the examples in the test set, in (0, 1).
        seed: Seed of the shuffle.

    Returns:
        ``((x_train, y_train), (x_test, y_test))``: ``x`` float32 of shape
        ``(n, image_size, image_size)``, ``y`` int64 labels 0..9 of shape ``(n,)``.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range.

    Example:
        >>> (x_train, y_train), (x_test, y_test) = load_digits(image_size=28)
        >>> x_train.shape, x_test.shape, x_train.dtype, y_train.dtype
        ((1438, 28, 28), (359, 28, 28), dtype('float32'), dtype('int64'))
    """
    _check_args(image_size, test_fraction, seed)
    images, labels = _read_sklearn_digits()
    images = images / np.float32(16.0)
    if image_size != 8:
        images = _frame(images, int(image_size))
    train, test = _stratified_split(labels, float(test_fraction), int(seed))
    return (images[train], labels[train]), (images[test], labels[test])
