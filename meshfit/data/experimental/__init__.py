"""``tf.data.experimental`` names used by the seeds: ``AutoShardPolicy``, ``DistributeOptions``."""

from meshfit._export import publish as _publish
from meshfit.data._options import AutoShardPolicy, DistributeOptions

__all__ = ["AutoShardPolicy", "DistributeOptions"]

_publish(__name__)
