"""`SidecarEvaluator`: the ``evaluator`` task; evaluates each new checkpoint the workers write.

The training workers save with ``ModelCheckpoint`` (``model.save`` folders or ``save_weights``
files) into ``checkpoint_dir``; the evaluator, a separate process (``meshfit launch --evaluator``
starts one with ``TF_CONFIG`` task type ``"evaluator"``), watches that folder, loads every new
complete save into its own copy of the model and evaluates it. Partial saves are never read: both
kinds of save are renamed into place only when complete, and scratch names (``.tmp``, ``.old``,
``.deleting``, see `meshfit._storage._atomic`) are recognised by the same rule every saver uses; a copy left
aside by a writer that crashed mid-swap is put back before looking.
"""

from __future__ import annotations

import os
import time
from typing import Any

from meshfit._engine._model import Model
from meshfit._saving import load_weights
from meshfit._storage import clean_directory, is_scratch_name

_WEIGHT_SUFFIX = ".safetensors"


def _saves(directory: str) -> list[str]:
    """Complete saves in ``directory``, oldest first: model folders and weight files."""
    clean_directory(directory)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        path = os.path.join(directory, name)
        if is_scratch_name(name):
            continue
        if os.path.isdir(path) and os.path.isfile(os.path.join(path, "model.safetensors")) \
                and os.path.isfile(os.path.join(path, "config.json")):
            found.append((os.path.getmtime(os.path.join(path, "config.json")), name, path))
        elif os.path.isfile(path) and name.endswith(_WEIGHT_SUFFIX):
            found.append((os.path.getmtime(path), name, path))
    return [path for *_, path in sorted(found)]


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except FileNotFoundError:
        return -1.0


class SidecarEvaluator:
    """Evaluate every new checkpoint that training writes, as TensorFlow's sidecar evaluator does.

    Args:
        model: a compiled `meshfit.Model` with the training model's architecture.
        data: evaluation data, as ``Model.evaluate`` takes it.
        checkpoint_dir: the folder ``ModelCheckpoint`` writes into.
        steps: evaluation steps per checkpoint (default: the whole data).
        max_evaluations: stop after this many evaluations (default: run until ``timeout``).
        timeout: stop when no new checkpoint appeared for this many seconds (default: wait forever
            when ``max_evaluations`` is None, else one hour).
        poll_interval: seconds between looks at ``checkpoint_dir``.

    Example:
        >>> import tempfile, torch, meshfit as mf
        >>> model = mf.Model(torch.nn.Linear(2, 1)); model.compile("sgd", "mse")
        >>> evaluator = mf.SidecarEvaluator(model, (torch.zeros(4, 2), torch.zeros(4, 1)), tempfile.mkdtemp(),
        ...                                 timeout=0.1)
        >>> evaluator.start()
        []
    """

    def __init__(self, model: Model, data: Any, checkpoint_dir: str | os.PathLike, steps: int | None = None,
                 max_evaluations: int | None = None, timeout: float | None = None,
                 poll_interval: float = 1.0) -> None:
        if max_evaluations is not None and (isinstance(max_evaluations, bool) or not isinstance(max_evaluations, int)
                                            or max_evaluations < 1):
            raise ValueError("Invalid `max_evaluations`: expected a positive int or None, received "
                             f"max_evaluations={max_evaluations!r}.")
        if not isinstance(model, Model):
            raise TypeError(f"Invalid `model`: expected a meshfit.Model, received {type(model).__name__}.")
        if not model.compiled:
            raise ValueError("Invalid `model`: compile it (loss and metrics) before building a SidecarEvaluator.")
        self.model, self.data, self.steps = model, data, steps
        self.checkpoint_dir = os.fspath(checkpoint_dir)
        self.max_evaluations = max_evaluations
        self.timeout = timeout if timeout is not None else (None if max_evaluations is None else 3600.0)
        self.poll_interval = poll_interval
        self.results: list[tuple[str, dict[str, float]]] = []

    def start(self) -> list[tuple[str, dict[str, float]]]:
        """Evaluate new checkpoints until ``max_evaluations`` or ``timeout``; returns (path, logs) pairs."""
        done: set[tuple[str, float]] = set()
        last_new = time.monotonic()
        while self.max_evaluations is None or len(self.results) < self.max_evaluations:
            fresh = [p for p in _saves(self.checkpoint_dir) if (p, _mtime(p)) not in done]
            if not fresh:
                if self.timeout is not None and time.monotonic() - last_new > self.timeout:
                    break
                time.sleep(self.poll_interval)
                continue
            path = fresh[-1]  # the newest; older unevaluated ones are skipped, as in TF
            try:
                done.update((p, _mtime(p)) for p in fresh)
                load_weights(self.model, path)
            except FileNotFoundError:  # replaced while we looked (a fixed-name save): look again
                continue
            last_new = time.monotonic()
            x, y = self.data if isinstance(self.data, tuple) and len(self.data) == 2 else (self.data, None)
            logs = self.model.evaluate(x, y, steps=self.steps, verbose=0, return_dict=True)
            self.results.append((path, logs))
            summary = " - ".join(f"{k}: {v:.4f}" for k, v in logs.items())
            print(f"SidecarEvaluator: {os.path.basename(path)} - {summary}", flush=True)
        return self.results
