"""The evaluation and prediction loops over a `Trainable`: written once, for every strategy."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from meshfit._engine._step_logs import reduce_logs
from meshfit._protocols import CallbackListLike, Trainable
from meshfit.data import batch_size_of, map_structure


def evaluate(trainable: Trainable, data: Any, callbacks: Any) -> dict[str, float]:
    """Loss and metrics over ``data`` (this replica's batches), reduced over all replicas."""
    strategy = trainable.strategy
    module = trainable.module
    was_training = module.training
    trainable.reset_metrics()
    callbacks.on_test_begin()
    logs: dict[str, float] = {}
    try:
        module.eval()
        with torch.no_grad():
            for step in range(data.steps):
                callbacks.on_test_batch_begin(step)
                strategy.check_alive()
                batch, _ = data.next_batch()
                if batch_size_of(batch):
                    trainable.test_step(strategy.distribute_batch(batch))
                logs, _ = reduce_logs(trainable)
                callbacks.on_test_batch_end(step, logs)
    finally:
        module.train(was_training)
    callbacks.on_test_end(logs)
    return logs


def predict(trainable: Trainable, data: Any, callbacks: CallbackListLike | Any) -> Any:
    """The outputs for all of ``data``, in input order, on every replica (numpy)."""
    strategy = trainable.strategy
    module = trainable.module
    was_training = module.training
    outputs: list[Any] = []
    callbacks.on_predict_begin()
    try:
        module.eval()
        with torch.no_grad():
            for step in range(data.steps):
                callbacks.on_predict_batch_begin(step)
                strategy.check_alive()
                batch, _ = data.next_batch()
                out = trainable.predict_step(strategy.distribute_batch(batch))
                outputs.append(map_structure(lambda t: t.detach().cpu().numpy(), out))
                callbacks.on_predict_batch_end(step, {"outputs": out})
    finally:
        module.train(was_training)
    callbacks.on_predict_end()
    if strategy.num_replicas_in_sync > 1 and getattr(data.source, "replicas_read_different_rows", True):
        by_replica = strategy.all_gather_object(outputs)
        outputs = [part for step in range(len(outputs)) for part in (r[step] for r in by_replica)]
    return concatenate(outputs)


def concatenate(outputs: list[Any]) -> Any:
    """Per-batch outputs (arrays, or tuples/dicts of them) joined along the batch dimension."""
    if not outputs:
        return np.zeros((0,))
    first = outputs[0]
    if isinstance(first, dict):
        return {k: concatenate([o[k] for o in outputs]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(concatenate([o[i] for o in outputs]) for i in range(len(first)))
    return np.concatenate(outputs, axis=0)
