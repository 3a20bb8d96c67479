"""`Options` and `AutoShardPolicy`: how a dataset is split across replicas."""

from __future__ import annotations

import dataclasses
import enum


class AutoShardPolicy(enum.Enum):
    """How a distributed dataset is divided between replicas, as in ``tf.data``.

    - ``AUTO``: ``FILE`` when the source is a list of files, else ``DATA``.
    - ``FILE``: replica ``r`` of ``n`` reads files ``r, r+n, ...``; each replica batches its own
      examples with the per-replica batch size.
    - ``DATA``: every replica walks the same global order; global batch ``i`` is cut into ``n``
      contiguous slices and replica ``r`` takes slice ``r``. The examples a step sees do not depend
      on the number of replicas.
    - ``OFF``: no sharding: every replica reads the whole dataset, batched with the per-replica
      batch size, so all replicas see the same examples (rarely what you want, as in TF).
    """

    AUTO = "auto"
    FILE = "file"
    DATA = "data"
    OFF = "off"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """Options attached to a dataset with ``Dataset.with_options``.

    Args:
        auto_shard_policy: how the dataset is split across replicas (see `AutoShardPolicy`).

    Example:
        >>> Options(auto_shard_policy=AutoShardPolicy.OFF)
        Options(auto_shard_policy=AutoShardPolicy.OFF)
    """

    auto_shard_policy: AutoShardPolicy = AutoShardPolicy.AUTO

    def __post_init__(self) -> None:
        if not isinstance(self.auto_shard_policy, AutoShardPolicy):
            raise TypeError(
                "Invalid `auto_shard_policy`: expected a meshfit.data.AutoShardPolicy member "
                f"(AUTO, FILE, DATA, OFF), received auto_shard_policy={self.auto_shard_policy!r}."
            )

    def __repr__(self) -> str:
        return f"Options(auto_shard_policy=AutoShardPolicy.{self.auto_shard_policy.name})"
