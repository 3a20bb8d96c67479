"""The training front end: `Model` (compile, the Keras steps, fit/evaluate/predict), the one training
loop, the evaluate/predict loops, per-step logs, the data handler, `load_model` and the sidecar evaluator.

A private layer package: meshfit's other packages import the names below from here, never its
``_``-modules; users import the public names from `meshfit`.
"""

from meshfit._engine._data_handler import DataHandler
from meshfit._engine._evaluation import evaluate
from meshfit._engine._loading import load_model
from meshfit._engine._loop import TrainingLoop
from meshfit._engine._model import Model
from meshfit._engine._sidecar import SidecarEvaluator

__all__ = [
    "DataHandler",
    "Model",
    "SidecarEvaluator",
    "TrainingLoop",
    "evaluate",
    "load_model",
]
