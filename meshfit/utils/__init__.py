"""Utilities around training: `plot_history` draws a `History` as a PNG."""

from meshfit.utils._plot import plot_history

__all__ = ["plot_history"]
