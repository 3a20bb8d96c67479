"""Utilities around training: `plot_history` draws a `History` as a PNG; `set_random_seed` seeds everything."""

from meshfit._export import publish as _publish
from meshfit.utils._plot import plot_history
from meshfit.utils._random import set_random_seed

__all__ = ["plot_history", "set_random_seed"]

_publish(__name__)
