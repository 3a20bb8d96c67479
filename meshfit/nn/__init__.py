"""Loss helpers for custom training loops under a strategy (TensorFlow's ``tf.nn``), `SyncBatchNorm`, and
activation checkpointing (Keras 3's `RematScope` and `remat`)."""

from meshfit._export import publish as _publish
from meshfit.nn._loss_scaling import compute_average_loss, scale_regularization_loss
from meshfit.nn._remat import RematScope, remat, rematerialized
from meshfit.nn._remat import current_remat_scope as current_remat_scope
from meshfit.nn._sync_batch_norm import SyncBatchNorm

__all__ = ["RematScope", "SyncBatchNorm", "compute_average_loss", "remat", "rematerialized",
           "scale_regularization_loss"]

_publish(__name__)
