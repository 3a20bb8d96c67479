"""Callbacks: hooks into `Model.fit`, `evaluate` and `predict`, with Keras's names."""

from meshfit.callbacks._backup_and_restore import BackupAndRestore
from meshfit.callbacks._callback import Callback
from meshfit.callbacks._callback_list import CallbackList
from meshfit.callbacks._checkpoint_saver import CheckpointSaver, SavePolicy
from meshfit.callbacks._csv_logger import CSVLogger
from meshfit.callbacks._early_stopping import EarlyStopping
from meshfit.callbacks._history import History
from meshfit.callbacks._model_checkpoint import ModelCheckpoint
from meshfit.callbacks._progbar import Progbar, ProgbarLogger
from meshfit.callbacks._tensorboard import TensorBoard

__all__ = [
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "CallbackList",
    "CheckpointSaver",
    "EarlyStopping",
    "History",
    "ModelCheckpoint",
    "Progbar",
    "ProgbarLogger",
    "SavePolicy",
    "TensorBoard",
]
