"""The Estimator's data: ``input_fn`` called as TF calls it, per input pipeline; inference restores."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from meshfit._engine import DataHandler
from meshfit._protocols import DistributionStrategy
from meshfit.data import Dataset
from meshfit.distribute import DistributedDataset
from meshfit.estimator._hooks import log
from meshfit.estimator._model_fn import accepts_input_context, call_input_fn

_UNBOUNDED = sys.maxsize // 2  # steps of one "epoch" of infinite data: training ends at its until_step


def input_data(estimator: Any, input_fn: Callable[..., Any], mode: str, strategy: DistributionStrategy,
               steps: int | None = None) -> DataHandler:
    """This replica's batches of ``input_fn``'s data.

    With several replicas, each worker calls ``input_fn`` itself (``distribute_datasets_from_
    function``): with an `InputContext` when it takes one, so that it can ``shard``. Its batches
    are per-replica batches, as in TF's Estimator. ``steps`` caps the number of batches.
    """
    params, config = estimator.params, estimator.config
    takes_context = accepts_input_context(input_fn)
    if strategy.num_replicas_in_sync > 1:
        if not takes_context and strategy.is_chief:
            log("input_fn takes no `input_context`: every worker reads the same examples. Accept "
                "input_fn(mode, input_context) and shard with input_context.input_pipeline_id.")
        source = strategy.distribute_datasets_from_function(
            lambda context: call_input_fn(input_fn, mode, params, config, context if takes_context else None))
    else:
        context = strategy.input_context() if takes_context and config.train_distribute is not None else None
        source = call_input_fn(input_fn, mode, params, config, context)
    if isinstance(source, tuple) and len(source) == 2 and not hasattr(source, "_fields"):
        raise TypeError("input_fn returned a (features, labels) pair of tensors; return a meshfit.data.Dataset "
                        "of (features, labels) batches instead, e.g. Dataset.from_tensor_slices((x, y)).batch(64).")
    finite = _finite(source)
    if not finite and mode != "train" and steps is None:
        raise ValueError(f"input_fn's data for mode {mode!r} is infinite (it ends with .repeat()), so `steps` must "
                         "be given: received steps=None.")
    data = DataHandler(source, None, None, None, None if finite else _UNBOUNDED, False, strategy,
                       argument="steps_per_epoch" if mode == "train" else "steps")
    if steps is not None:
        data.steps = min(steps, data.steps) if data.steps is not None else steps
    return data


def _finite(source: Any) -> bool:
    if isinstance(source, DistributedDataset):
        return source.length() is not None
    if isinstance(source, Dataset):
        return source.node.length() is not None
    try:
        len(source)
    except TypeError:
        return False
    return True


def is_finite(data: DataHandler) -> bool:
    return data.steps != _UNBOUNDED


def restore_for_inference(trainable: Any, path: str) -> int:
    """Load the module weights of checkpoint ``path`` into ``trainable``; returns its global step.

    Under a strategy with several replicas they all read it together; otherwise this process reads
    it alone (an evaluator, or one worker evaluating by itself).
    """
    from meshfit.estimator._sharding import is_sharded_module
    from meshfit.estimator._trainable import ModulesState
    from meshfit.estimator._variables import load_modules
    from meshfit.train import Checkpoint

    sharded = any(is_sharded_module(m) for m in trainable.caller.modules.values())
    if trainable.strategy.num_replicas_in_sync == 1 and not sharded:
        return load_modules(path, trainable.caller.modules)
    step = _GlobalStep()
    Checkpoint(model=ModulesState(trainable.caller.modules), loop=step).restore(path)
    return step.value


class _GlobalStep:
    """Reads only the global step from the training loop's saved state."""

    value = 0

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = int(state["counters"]["iterations"])
