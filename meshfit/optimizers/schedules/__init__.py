"""Learning-rate schedules (Keras's ``keras.optimizers.schedules``): pass one as ``learning_rate=``."""

from meshfit._export import publish as _publish
from meshfit.optimizers.schedules._schedules import (
    CosineDecay,
    ExponentialDecay,
    LearningRateSchedule,
    PiecewiseConstantDecay,
    deserialize,
    serialize,
)

__all__ = [
    "CosineDecay",
    "ExponentialDecay",
    "LearningRateSchedule",
    "PiecewiseConstantDecay",
    "deserialize",
    "serialize",
]

_publish(__name__)
