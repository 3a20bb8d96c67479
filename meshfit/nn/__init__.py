"""Loss helpers for custom training loops under a strategy (TensorFlow's ``tf.nn``)."""

from meshfit.nn._loss_scaling import compute_average_loss, scale_regularization_loss

__all__ = ["compute_average_loss", "scale_regularization_loss"]
