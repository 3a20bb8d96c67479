"""`set_random_seed`: one call seeds Python's `random`, NumPy and torch (CPU and every CUDA device)."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_random_seed(seed: int) -> None:
    """Sets all random seeds of the program: Python's ``random``, NumPy and torch, as Keras's does.

    The same as::

        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)  # the CPU generator and, when CUDA is present, every device's

    Call it with the same seed on every worker before building a model, so that every worker
    initializes the same weights (the DTensor guide's ``tf.keras.utils.set_random_seed(1337)`` on
    every client). Ops that are non-deterministic on the accelerator stay so; see
    ``torch.use_deterministic_algorithms``.

    Args:
        seed: the seed, an int in ``[0, 2**32)`` (NumPy's range; Keras passes it to NumPy as well).

    Raises:
        ValueError: ``seed`` is not an int (a bool is refused too), or is outside ``[0, 2**32)``;
            Keras raises the same error type.

    Example:
        >>> import torch
        >>> from meshfit.utils import set_random_seed
        >>> set_random_seed(1337)
        >>> first = torch.rand(2)
        >>> set_random_seed(1337)
        >>> bool(torch.equal(first, torch.rand(2)))
        True
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"Invalid `seed`: expected `seed` argument to be an integer, received seed={seed!r} "
                         f"(of type {type(seed).__name__}). Pass an int, e.g. set_random_seed(1337).")
    if not 0 <= seed < 2**32:
        raise ValueError(f"Invalid `seed`: expected an integer in [0, 2**32) (NumPy's seed range), "
                         f"received seed={seed}.")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device (lazily, when CUDA initializes)
