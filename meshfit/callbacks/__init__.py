"""Callbacks: hooks into `Model.fit`, `evaluate` and `predict`, with Keras's names."""

from meshfit._export import publish as _publish
from meshfit.callbacks._backup_and_restore import BackupAndRestore
from meshfit.callbacks._callback import Callback
from meshfit.callbacks._callback_list import CallbackList
from meshfit.callbacks._callback_list import implements_hook as implements_hook  # a seam (the training loop)
from meshfit.callbacks._checkpoint_saver import CheckpointSaver, SavePolicy
from meshfit.callbacks._checkpoint_saver import checkpoint_settings as checkpoint_settings  # a seam (fit)
from meshfit.callbacks._csv_logger import CSVLogger
from meshfit.callbacks._early_stopping import EarlyStopping
from meshfit.callbacks._history import History
from meshfit.callbacks._lambda_callback import LambdaCallback
from meshfit.callbacks._learning_rate_scheduler import LearningRateScheduler
from meshfit.callbacks._model_checkpoint import ModelCheckpoint
from meshfit.callbacks._progbar import Progbar

# Seams for meshfit's other packages (not public API: not in __all__).
from meshfit.callbacks._progbar import announce_quiet_worker as announce_quiet_worker
from meshfit.callbacks._progbar import supports_redraw as supports_redraw
from meshfit.callbacks._progbar_logger import ProgbarLogger
from meshfit.callbacks._reduce_lr_on_plateau import ReduceLROnPlateau
from meshfit.callbacks._tensorboard import TensorBoard
from meshfit.callbacks._terminate_on_nan import TerminateOnNaN
from meshfit.callbacks._verify_replicas import VerifyReplicas

__all__ = [
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "CallbackList",
    "CheckpointSaver",
    "EarlyStopping",
    "History",
    "LambdaCallback",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "Progbar",
    "ProgbarLogger",
    "ReduceLROnPlateau",
    "SavePolicy",
    "TensorBoard",
    "TerminateOnNaN",
    "VerifyReplicas",
]

_publish(__name__)
