"""Loss helpers for custom training loops under a strategy (TensorFlow's ``tf.nn``), and `SyncBatchNorm`."""

from meshfit._export import publish as _publish
from meshfit.nn._loss_scaling import compute_average_loss, scale_regularization_loss
from meshfit.nn._sync_batch_norm import SyncBatchNorm

__all__ = ["SyncBatchNorm", "compute_average_loss", "scale_regularization_loss"]

_publish(__name__)
