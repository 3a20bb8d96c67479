"""Reading what the worker scripts in tests/scripts write into their ``--out`` folder.

A script saves each rank's trained weights as ``weights-<rank>.npz``, the arrays of
``model.get_weights()`` in order under the keys ``w0``, ``w1``, ...
"""

from __future__ import annotations

import os

import numpy as np


def read_weights(out: str, rank: int) -> list[np.ndarray]:
    """Rank ``rank``'s weights from ``out/weights-<rank>.npz``, in the order the script saved them."""
    with np.load(os.path.join(out, f"weights-{rank}.npz")) as f:
        return [f[f"w{i}"] for i in range(len(f.files))]


def assert_ranks_saved(out: str, ranks, expected: list[np.ndarray], err_msg: str = "") -> None:
    """Each of ``ranks`` saved into ``out`` exactly the arrays ``expected``: as many, each bitwise equal."""
    for rank in ranks:
        for got, want in zip(read_weights(out, rank), expected, strict=True):
            np.testing.assert_array_equal(got, want, err_msg=err_msg)
