"""Optimizers: Keras-style specs that build `torch.optim` optimizers, and `get`, `serialize`, `deserialize`."""

from meshfit._export import publish as _publish
from meshfit.optimizers import schedules
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
