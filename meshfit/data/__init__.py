"""Input pipelines: `Dataset`, `Options`, `AutoShardPolicy`."""

from meshfit._export import publish as _publish
from meshfit.data import experimental
from meshfit.data._dataset import AUTOTUNE, INFINITE, Dataset, DatasetIterator
from meshfit.data._node import Node as Node
from meshfit.data._options import AutoShardPolicy, DistributeOptions, Options
from meshfit.data._prefetch import Prefetcher as Prefetcher
from meshfit.data._sources import Files as Files
from meshfit.data._sources import TorchMapDataset as TorchMapDataset
from meshfit.data._structure import batch_size_of as batch_size_of
from meshfit.data._structure import leaves as leaves
from meshfit.data._structure import map_structure as map_structure
from meshfit.data._structure import slice_rows as slice_rows
from meshfit.data._structure import to_tensor as to_tensor
from meshfit.data._structure import unpack_batch as unpack_batch
from meshfit.data._topology import data_topology as data_topology
from meshfit.data._topology import topology_mismatches as topology_mismatches

# Seams for meshfit's other packages (not public API: not in __all__).
from meshfit.data._transforms import Batch as Batch
from meshfit.data._transforms import Prefetch as Prefetch
from meshfit.data._transforms import Shuffle as Shuffle
from meshfit.data._transforms import Skip as Skip
from meshfit.data._transforms import Take as Take
from meshfit.data._transforms import reseed_shuffles as reseed_shuffles

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

_publish(__name__)
