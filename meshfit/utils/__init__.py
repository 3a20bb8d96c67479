"""Utilities around training: `plot_history` draws a `History` as a PNG."""

from meshfit._export import publish as _publish
from meshfit.utils._plot import plot_history

__all__ = ["plot_history"]

_publish(__name__)
