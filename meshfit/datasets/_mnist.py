"""`load_mnist`: MNIST from a local ``mnist.npz`` in Keras's layout (meshfit never downloads)."""

from __future__ import annotations

import os
import zipfile

import numpy as np

__all__ = ["load_mnist"]

MNIST_URL = "https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz"
_KEYS = ("x_train", "y_train", "x_test", "y_test")


def _check_pair(path: str, x: np.ndarray, y: np.ndarray, x_key: str, y_key: str) -> None:
    """Raises ValueError unless ``x`` is (n, 28, 28) images and ``y`` is (n,) labels."""
    if x.ndim != 3 or x.shape[1:] != (28, 28):
        raise ValueError(
            f"Invalid MNIST file {path!r}: expected `{x_key}` of shape (n, 28, 28), received {x.shape}."
        )
    if y.shape != (x.shape[0],):
        raise ValueError(
            f"Invalid MNIST file {path!r}: expected `{y_key}` of shape ({x.shape[0]},) to match `{x_key}`, "
            f"received {y.shape}."
        )


def load_mnist(
    path: str | os.PathLike[str],
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Loads MNIST from a local ``mnist.npz`` file, as ``keras.datasets.mnist.load_data`` stores it.

    The file must be downloaded beforehand (meshfit never downloads), e.g. from
    ``https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz``. It is read without
    unpickling. Arrays are returned as stored (uint8 images): scale them yourself, as with Keras.

    Args:
        path: The ``.npz`` file, or a directory containing ``mnist.npz``.

    Returns:
        ``((x_train, y_train), (x_test, y_test))`` with ``x`` of shape ``(n, 28, 28)``.

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: If it is not a readable npz file, lacks one of ``x_train``, ``y_train``,
            ``x_test``, ``y_test``, or an array has the wrong shape.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "mnist.npz")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"No MNIST file at {path!r}. meshfit does not download data sets: download mnist.npz "
            f"beforehand (e.g. from {MNIST_URL}) and pass its path to load_mnist."
        )
    try:
        npz = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
        raise ValueError(f"Invalid MNIST file {path!r}: not a readable .npz file ({err}).") from err
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise ValueError(
            f"Invalid MNIST file {path!r}: expected an .npz archive with keys {list(_KEYS)}, received a single array."
        )
    with npz:
        missing = [key for key in _KEYS if key not in npz.files]
        if missing:
            raise ValueError(
                f"Invalid MNIST file {path!r}: missing arrays {missing}; expected keys {list(_KEYS)}, "
                f"found {sorted(npz.files)}."
            )
        try:
            arrays = {key: npz[key] for key in _KEYS}
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
            raise ValueError(f"Invalid MNIST file {path!r}: cannot read its arrays ({err}).") from err
    _check_pair(path, arrays["x_train"], arrays["y_train"], "x_train", "y_train")
    _check_pair(path, arrays["x_test"], arrays["y_test"], "x_test", "y_test")
    return (arrays["x_train"], arrays["y_train"]), (arrays["x_test"], arrays["y_test"])
