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


def _check_policy(policy: object) -> AutoShardPolicy:
    if not isinstance(policy, AutoShardPolicy):
        raise TypeError(
            "Invalid `auto_shard_policy`: expected a meshfit.data.AutoShardPolicy member "
            f"(AUTO, FILE, DATA, OFF), received auto_shard_policy={policy!r}."
        )
    return policy


class DistributeOptions:
    """``options.experimental_distribute``: TensorFlow's spelling of the sharding option.

    Setting ``options.experimental_distribute.auto_shard_policy = ...`` sets the owning
    `Options`' ``auto_shard_policy`` (the one mutable path, as ``tf.data.Options`` is mutable).
    """

    __slots__ = ("_options",)

    def __init__(self, options: Options) -> None:
        self._options = options

    @property
    def auto_shard_policy(self) -> AutoShardPolicy:
        """How the dataset is split across replicas."""
        return self._options.auto_shard_policy

    @auto_shard_policy.setter
    def auto_shard_policy(self, policy: AutoShardPolicy) -> None:
        object.__setattr__(self._options, "auto_shard_policy", _check_policy(policy))

    def __repr__(self) -> str:
        return f"DistributeOptions(auto_shard_policy=AutoShardPolicy.{self.auto_shard_policy.name})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """Options attached to a dataset with ``Dataset.with_options``.

    Args:
        auto_shard_policy: how the dataset is split across replicas (see `AutoShardPolicy`). The
            seeds' ``options.experimental_distribute.auto_shard_policy = ...`` sets it too.

    Example:
        >>> Options(auto_shard_policy=AutoShardPolicy.OFF)
        Options(auto_shard_policy=AutoShardPolicy.OFF)
        >>> options = Options()
        >>> options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
        >>> options
        Options(auto_shard_policy=AutoShardPolicy.DATA)
    """

    auto_shard_policy: AutoShardPolicy = AutoShardPolicy.AUTO

    def __post_init__(self) -> None:
        _check_policy(self.auto_shard_policy)

    @property
    def experimental_distribute(self) -> DistributeOptions:
        """TensorFlow's ``tf.data.experimental.DistributeOptions`` view of these options."""
        return DistributeOptions(self)

    def __repr__(self) -> str:
        return f"Options(auto_shard_policy=AutoShardPolicy.{self.auto_shard_policy.name})"
