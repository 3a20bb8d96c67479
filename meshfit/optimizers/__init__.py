"""Optimizers: Keras-style specs that build `torch.optim` optimizers, and `get`, `serialize`, `deserialize`."""

from meshfit._export import publish as _publish
from meshfit.optimizers import schedules
from meshfit.optimizers._accumulation import (
    AccumulatedGradients as AccumulatedGradients,  # seams (not in __all__)
)
from meshfit.optimizers._accumulation import defers_update as defers_update
from meshfit.optimizers._accumulation import inside_window as inside_window
from meshfit.optimizers._builtin import SGD, Adagrad, Adam, AdamW, RMSprop, TorchOptimizer
from meshfit.optimizers._optimizers import Optimizer
from meshfit.optimizers._resolve import deserialize, get, serialize

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "Optimizer",
    "RMSprop",
    "TorchOptimizer",
    "deserialize",
    "get",
    "schedules",
    "serialize",
]

_publish(__name__)
