"""Small data sets: `load_digits` (bundled with scikit-learn) and `load_mnist` (from a local file)."""

from meshfit._export import publish as _publish
from meshfit.datasets._digits import load_digits
from meshfit.datasets._mnist import load_mnist

__all__ = ["load_digits", "load_mnist"]

_publish(__name__)
