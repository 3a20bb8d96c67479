"""Input pipelines: `Dataset`, `Options`, `AutoShardPolicy`."""

from meshfit.data import experimental
from meshfit.data._dataset import AUTOTUNE, INFINITE, Dataset, DatasetIterator
from meshfit.data._options import AutoShardPolicy, DistributeOptions, Options

__all__ = [
    "AUTOTUNE",
    "INFINITE",
    "AutoShardPolicy",
    "Dataset",
    "DatasetIterator",
    "DistributeOptions",
    "Options",
    "experimental",
]
