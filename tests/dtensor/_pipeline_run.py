"""The pipeline tests' runs: the model split by a layout map on a mesh (or one plain process), trained by
``fit`` with every reader a user calls (callbacks, evaluate, predict, save, get_weights, the digest)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from _pipeline_model import Classifier, compile_model, data
from torch import nn


def _data(rows: int = 64) -> tuple[np.ndarray, np.ndarray]:
    return data(rows)


def _model(mesh_dims: Sequence[tuple[str, int]] | None, *pipeline: Any, kind: Any = None,
           module: Callable[[], nn.Module] = Classifier, optimizer: Any = None, sharded: bool = False,
           **options: Any) -> Any:
    """The tests' model: ``module()`` split into stages by ``layout_map.pipeline(*pipeline, **options)`` on a
    mesh of ``mesh_dims`` (None: one plain process), as ``kind`` (default `mf.Model`); compiled with
    ``optimizer`` and the loss alone, or (no optimizer) as `compile_model` does: Adam 0.01 and accuracy.
    ``sharded``: the stages fully sharded over the data axis (``LayoutMap.fully_sharded(mesh).pipeline``)."""
    import meshfit as mf

    build = kind or mf.Model
    if mesh_dims is None:
        model = build(module())
    else:
        mesh = mf.dtensor.create_mesh(list(mesh_dims))
        layout_map = mf.dtensor.LayoutMap.fully_sharded(mesh) if sharded else mf.dtensor.LayoutMap(mesh)
        with layout_map.pipeline(*pipeline, **options).scope():
            model = build(module())
    if optimizer is None:
        compile_model(mf, model)
    else:
        model.compile(optimizer=optimizer, loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _counting(steps: list[int]) -> Any:
    """A callback that appends each training batch's index to ``steps``."""
    import meshfit as mf

    return mf.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: steps.append(batch))


def _every(model: Any) -> dict[str, np.ndarray]:
    """Every stage's weights by path (``get_weights``: each from the process that trains it)."""
    return dict(zip(model.module.state_dict(), model.get_weights(), strict=True))


def assert_every_close(got: dict[str, Any], want: dict[str, np.ndarray]) -> None:
    """Every weight ``want`` names (by path) matched in ``got`` to rtol 1e-5, atol 1e-6."""
    for path, value in want.items():
        np.testing.assert_allclose(got[path], value, rtol=1e-5, atol=1e-6, err_msg=path)


def _one_process(rows: int = 64, epochs: int = 2) -> tuple[dict[str, np.ndarray], dict[str, list[float]], int]:
    import meshfit as mf

    model = _model(None)
    x, y = _data(rows)
    history = model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    weights = {k: v.detach().numpy().copy() for k, v in model.module.state_dict().items()}
    logs = dict(history.history)
    logs["evaluated"] = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    logs["predicted"] = np.asarray(model.predict(x, batch_size=16, verbose=0))
    return weights, logs, mf.train.state_digest(model).total


def _pipeline(rank: int, world_size: int, directory: str, schedule: str, split_points: list[str],
              stages_per_rank: int, mesh_dims: tuple[tuple[str, int], ...] = (("pipe", 2),), rows: int = 64,
              microbatches: int = 4, sharded: bool = False) -> dict[str, Any]:
    import meshfit as mf

    model = _model(mesh_dims, split_points, microbatches=microbatches, schedule=schedule,
                   stages_per_rank=stages_per_rank, sharded=sharded)
    x, y = _data(rows)
    read: list[dict[str, float]] = []  # a callback reading the metrics directly, on every process

    class ReadMetrics(mf.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            read.append({m.name: float(m.result()) for m in self.model.metrics})

    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                        callbacks=[mf.callbacks.BackupAndRestore(os.path.join(directory, "backup"), save_freq=4,
                                                                 delete_checkpoint=False),
                                   mf.callbacks.VerifyReplicas(every_n_steps=2, on_divergence="stop"), ReadMetrics(),
                                   mf.callbacks.ModelCheckpoint(os.path.join(directory, "epoch.keras"))])
    verified = model.strategy.verify_replicas(model)
    evaluated = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    predicted = model.predict(x, batch_size=16, verbose=0)
    model.save(os.path.join(directory, "model.keras"))
    every = _every(model)  # every stage's, completed
    return {"history": history.history, "read": read, "compared": verified.compared, "one_copy": verified.one_copy,
            "evaluated": evaluated, "predicted": np.asarray(predicted), "every": every,
            "digest": mf.train.state_digest(model).total,
            "stage": {k: _whole(v).detach().numpy().copy() for k, v in model.module.state_dict().items()
                      if model.residency.holds(k)}}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A fully sharded stage's tensor gathered (collective among the stage's ranks); a plain one as it is."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def refusal(call: Callable[[], Any], any_error: bool = False) -> str:
    """What ``call()`` is refused with: a ValueError's message (any exception's, its type named, with
    ``any_error``: what each process is told, a lost peer included); ``"not refused"`` when it runs."""
    try:
        call()
    except ValueError as error:
        return f"{type(error).__name__}: {error}" if any_error else str(error)
    except Exception as error:
        if not any_error:
            raise
        return f"{type(error).__name__}: {error}"
    return "not refused"
