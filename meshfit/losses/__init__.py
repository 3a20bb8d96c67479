"""Losses: Keras-style `Loss` classes and `get`, `serialize`, `deserialize`."""

from meshfit.losses._losses import (
    BinaryCrossentropy,
    CategoricalCrossentropy,
    Huber,
    Loss,
    MeanAbsoluteError,
    MeanSquaredError,
    SparseCategoricalCrossentropy,
)
from meshfit.losses._resolve import deserialize, get, serialize

__all__ = [
    "BinaryCrossentropy",
    "CategoricalCrossentropy",
    "Huber",
    "Loss",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "SparseCategoricalCrossentropy",
    "deserialize",
    "get",
    "serialize",
]
