"""`RunConfig`: how an `Estimator` runs — strategies, checkpoint frequency, logging — as in TF.

A frozen value object with ``tf.estimator.RunConfig``'s defaults: a checkpoint every 600 seconds
unless ``save_checkpoints_steps`` is given (giving both is an error), the newest 5 kept, a log line
every 100 steps. The cluster role (chief, worker, evaluator) comes from the training strategy's
cluster resolver, else from the environment (``TF_CONFIG``, torchrun, SLURM).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from meshfit._protocols import DistributionStrategy
from meshfit._validation import invalid_argument, is_int
from meshfit.cluster import resolve_cluster

_USE_DEFAULT: Any = type("_UseDefault", (), {"__repr__": lambda self: "<default>"})()
_DEFAULT_SAVE_SECS = 600
_BOTH_SET = ("Invalid `save_checkpoints_steps` and `save_checkpoints_secs`: they cannot both be set, "
             "received save_checkpoints_steps={!r}, save_checkpoints_secs={!r}. Pass one of them "
             "(or neither: a checkpoint every 600 seconds).")


def _optional_count(name: str, value: Any, minimum: int) -> None:
    if value is not None and (not is_int(value) or value < minimum):
        raise invalid_argument(name, f"None or an int >= {minimum}", value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """How an `Estimator` runs (``tf.estimator.RunConfig``).

    Args:
        model_dir: where checkpoints and summaries go (the `Estimator`'s ``model_dir`` wins).
        tf_random_seed: seeds torch, numpy and Python's ``random`` before ``model_fn`` first builds
            modules, so weights start the same in every run (None: leave the streams alone).
        save_summary_steps: the chief writes ``loss`` and ``global_step/sec`` to TensorBoard event
            files in ``model_dir`` every this many steps (None or 0: none).
        save_checkpoints_steps: checkpoint every this many global steps.
        save_checkpoints_secs: checkpoint every this many seconds (default 600 when neither is
            given). Both None: no periodic checkpoints (one is still written when training ends).
        keep_checkpoint_max: how many recent checkpoints to keep (None or 0: all).
        log_step_count_steps: log ``loss = …, step = …`` and ``global_step/sec`` every this many
            steps, on the chief (None: no step logs).
        train_distribute: the strategy ``train`` runs under (any meshfit strategy; default: the
            strategy of the enclosing scope, else one device).
        eval_distribute: the strategy ``evaluate`` and ``predict`` run under (default:
            ``train_distribute``).

    Raises:
        ValueError: a value is out of range, or both checkpoint frequencies are set.

    Example:
        >>> RunConfig().save_checkpoints_secs, RunConfig().keep_checkpoint_max
        (600, 5)
        >>> RunConfig(save_checkpoints_steps=1).save_checkpoints_secs is None
        True
    """

    model_dir: str | None = None
    tf_random_seed: int | None = None
    save_summary_steps: int | None = 100
    save_checkpoints_steps: int | None = _USE_DEFAULT
    save_checkpoints_secs: float | None = _USE_DEFAULT
    keep_checkpoint_max: int | None = 5
    log_step_count_steps: int | None = 100
    train_distribute: DistributionStrategy | None = None
    eval_distribute: DistributionStrategy | None = None

    def __post_init__(self) -> None:
        steps, secs = self.save_checkpoints_steps, self.save_checkpoints_secs
        if steps is _USE_DEFAULT and secs is _USE_DEFAULT:
            steps, secs = None, _DEFAULT_SAVE_SECS
        elif secs is _USE_DEFAULT:
            secs = None
        elif steps is _USE_DEFAULT:
            steps = None
        elif steps is not None and secs is not None:
            raise ValueError(_BOTH_SET.format(steps, secs))
        object.__setattr__(self, "save_checkpoints_steps", steps)
        object.__setattr__(self, "save_checkpoints_secs", secs)
        _optional_count("save_checkpoints_steps", steps, 1)
        if secs is not None and (isinstance(secs, bool) or not isinstance(secs, (int, float)) or secs <= 0):
            raise invalid_argument("save_checkpoints_secs", "None or a number > 0", secs)
        _optional_count("save_summary_steps", self.save_summary_steps, 0)
        _optional_count("keep_checkpoint_max", self.keep_checkpoint_max, 0)
        _optional_count("log_step_count_steps", self.log_step_count_steps, 0)
        if self.tf_random_seed is not None and (not is_int(self.tf_random_seed) or self.tf_random_seed < 0):
            raise invalid_argument("tf_random_seed", "None or an int >= 0", self.tf_random_seed)
        if self.model_dir is not None:
            if not isinstance(self.model_dir, (str, os.PathLike)) or not os.fspath(self.model_dir):
                raise invalid_argument("model_dir", "None or a non-empty path", self.model_dir, TypeError)
            object.__setattr__(self, "model_dir", os.fspath(self.model_dir))
        for name in ("train_distribute", "eval_distribute"):
            strategy = getattr(self, name)
            if strategy is not None and not hasattr(strategy, "num_replicas_in_sync"):
                raise invalid_argument(name, "a meshfit strategy (e.g. mf.MultiWorkerMirroredStrategy()) or None",
                            strategy, TypeError)

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with ``changes`` (TF's ``RunConfig.replace``).

        Giving one checkpoint frequency clears the other, as in TF.
        """
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"Invalid RunConfig.replace arguments: {unknown} are not RunConfig fields.")
        if "save_checkpoints_steps" in changes and "save_checkpoints_secs" not in changes:
            changes["save_checkpoints_secs"] = None
        if "save_checkpoints_secs" in changes and "save_checkpoints_steps" not in changes:
            changes["save_checkpoints_steps"] = None
        return dataclasses.replace(self, **changes)

    # ---- the cluster role, as TF's RunConfig reports it --------------------------------------
    def _resolver(self) -> Any:
        strategy = self.train_distribute
        if strategy is not None and not strategy.cluster_resolver.synthetic:
            return strategy.cluster_resolver
        return resolve_cluster()  # as TF's RunConfig: TF_CONFIG, whatever the strategy made up

    @property
    def task_type(self) -> str:
        """``"chief"``, ``"worker"`` or ``"evaluator"`` (``"worker"`` when alone)."""
        resolver = self._resolver()
        return resolver.task_type if resolver is not None else "worker"

    @property
    def task_id(self) -> int:
        """This task's index in its job."""
        resolver = self._resolver()
        return resolver.task_id if resolver is not None else 0

    @property
    def is_chief(self) -> bool:
        """Whether this task writes checkpoints and logs."""
        if self.train_distribute is not None and self.task_type != "evaluator":
            return bool(self.train_distribute.is_chief)
        resolver = self._resolver()
        return bool(resolver.is_chief) if resolver is not None else True

    @property
    def num_worker_replicas(self) -> int:
        """How many training tasks (chief and workers) the cluster has."""
        resolver = self._resolver()
        return resolver.world_size if resolver is not None else 1

    @property
    def cluster_spec(self) -> dict[str, list[str | None]]:
        """The cluster's jobs ``{"chief"|"worker"|"evaluator": [addresses]}`` (empty when alone)."""
        resolver = self._resolver()
        if resolver is None:
            return {}
        spec = resolver.cluster_spec()
        return dict(spec.as_dict() if hasattr(spec, "as_dict") else spec)

    def __repr__(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"RunConfig({fields})"
