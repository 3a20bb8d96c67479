"""Optimizers: Keras-style specs that build `torch.optim` optimizers, and `get`, `serialize`, `deserialize`."""

from meshfit.optimizers import schedules
from meshfit.optimizers._optimizers import (
    SGD,
    Adagrad,
    Adam,
    AdamW,
    Optimizer,
    RMSprop,
    TorchOptimizer,
    deserialize,
    get,
    serialize,
)

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
