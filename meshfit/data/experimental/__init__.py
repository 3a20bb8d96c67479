"""``tf.data.experimental`` names used by the seeds: ``AutoShardPolicy``, ``DistributeOptions``."""

from meshfit.data._options import AutoShardPolicy, DistributeOptions

__all__ = ["AutoShardPolicy", "DistributeOptions"]
