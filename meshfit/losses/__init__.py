"""Losses: Keras-style `Loss` classes and `get`, `serialize`, `deserialize`."""

from meshfit._export import publish as _publish
from meshfit.losses._crossentropy import (
    BinaryCrossentropy,
    CategoricalCrossentropy,
    SparseCategoricalCrossentropy,
)
from meshfit.losses._losses import Huber, Loss, MeanAbsoluteError, MeanSquaredError

# Seams for meshfit's other packages (not public API: not in __all__).
from meshfit.losses._losses import broadcast_weight as broadcast_weight
from meshfit.losses._losses import snake_case as snake_case
from meshfit.losses._losses import squeeze_or_expand as squeeze_or_expand
from meshfit.losses._losses import to_same_rank as to_same_rank
from meshfit.losses._resolve import TorchModuleLoss as TorchModuleLoss
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

_publish(__name__)
