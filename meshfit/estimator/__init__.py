"""`mf.estimator`: TensorFlow's Estimator API — ``model_fn``, ``input_fn``, `RunConfig`, hooks and
`train_and_evaluate` — on PyTorch, trained by the same loop as `Model.fit`, resumable from ``model_dir``;
`model_to_estimator` turns a compiled `meshfit.Model` into one.
"""

from meshfit._export import publish as _publish
from meshfit.estimator._estimator import Estimator
from meshfit.estimator._from_keras import model_to_estimator
from meshfit.estimator._hooks import (
    LoggingTensorHook,
    SessionRunArgs,
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
    StopAtStepHook,
)
from meshfit.estimator._model_fn import FreshModuleError, get_global_step, get_or_create_global_step, once
from meshfit.estimator._run_config import RunConfig
from meshfit.estimator._saver_hook import CheckpointSaverHook, CheckpointSaverListener
from meshfit.estimator._spec import EstimatorSpec, EvalSpec, ModeKeys, TrainSpec
from meshfit.estimator._train_op import TrainOp, minimize
from meshfit.estimator._training import train_and_evaluate

__all__ = [
    "CheckpointSaverHook",
    "CheckpointSaverListener",
    "Estimator",
    "EstimatorSpec",
    "EvalSpec",
    "FreshModuleError",
    "LoggingTensorHook",
    "ModeKeys",
    "RunConfig",
    "SessionRunArgs",
    "SessionRunContext",
    "SessionRunHook",
    "SessionRunValues",
    "StopAtStepHook",
    "TrainOp",
    "TrainSpec",
    "get_global_step",
    "get_or_create_global_step",
    "minimize",
    "model_to_estimator",
    "once",
    "train_and_evaluate",
]

_publish(__name__)
