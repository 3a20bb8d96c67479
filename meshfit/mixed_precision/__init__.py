"""Mixed precision, with Keras's names: ``mf.mixed_precision.set_global_policy("mixed_bfloat16")``."""

from meshfit._export import publish as _publish
from meshfit.mixed_precision._loss_scale_optimizer import LossScaleOptimizer
from meshfit.mixed_precision._policy import (
    Policy,
    autocast,
    global_policy,
    set_global_policy,
    to_variable_dtype,
)

__all__ = ["LossScaleOptimizer", "Policy", "autocast", "global_policy", "set_global_policy", "to_variable_dtype"]

_publish(__name__)
