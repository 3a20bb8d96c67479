"""A worker script for tests/test_save_collective.py: TensorFlow's tutorial saves, then PyTorch's habit.

Run under TF_CONFIG on 2 workers. Ported from seed 000 (TensorFlow's "Multi-worker training with
Keras" tutorial, its "Model saving and loading" part): every worker saves, the chief to ``model_path``
and the others to a temporary path (``write_filepath``) that they delete right after; then every
worker loads ``model_path`` at once. Repeated ``--saves`` times, cycling through a folder, a ``.keras``
file and ``save_weights`` to a ``.safetensors`` file, with one training step (a collective) between
saves, so each save holds other weights. Then:

- the chief's save fails (its folder's parent is a file): every worker's call raises;
- ``--chief-alone``, PyTorch's habit: the chief alone saves (``if is_chief(...)``), the others go
  on, and after a barrier load it;
- ``--other-alone``: the other worker alone saves while the chief ends without saving: it raises at
  once (a run of its own: the chief's saves alone would have moved the chief's count ahead).

Each worker writes ``<out>/worker<task_id>.json``: per save, "ok" when the file loaded at once held
the weights this worker saved, else what it found; the errors and seconds of the later parts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np
import torch
from torch import nn

import meshfit as mf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for its helpers
from _tutorial_paths import get_temp_dir, is_chief, write_filepath  # noqa: E402

FORMATS = ("folder", "keras", "weights")
NAMES = {"folder": "keras-model", "keras": "keras-model.keras", "weights": "weights.safetensors"}


def _module() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _loaded_weights(fmt: str, model_path: str) -> list[np.ndarray]:
    if fmt == "weights":
        plain = mf.Model(_module())
        plain.load_weights(model_path)
        return plain.get_weights()
    return mf.load_model(model_path).get_weights()


def _what_loaded(fmt: str, model_path: str, expected: list[np.ndarray]) -> str:
    try:
        weights = _loaded_weights(fmt, model_path)
    except Exception as error:  # reported for the test to read
        return f"{type(error).__name__}: {error}"
    same = all(np.array_equal(a, b) for a, b in zip(weights, expected, strict=True))
    return "ok" if same else "other weights (an older save)"


def _save(model: mf.Model, fmt: str, path: str) -> None:
    if fmt == "weights":
        model.save_weights(path)
    else:
        model.save(path)


def _failed_save(strategy, model, out, task_type, task_id, record) -> None:
    """The chief's save fails (its folder's parent is a file): every worker's call raises."""
    blocker = os.path.join(out, "blocker")
    if is_chief(task_type, task_id):
        with open(blocker, "w") as f:
            f.write("a file where the chief's folder should go\n")
    strategy.barrier()
    own = os.path.join(blocker if is_chief(task_type, task_id) else get_temp_dir(out, task_id), "keras-model")
    try:
        model.save(own)
        record["failed_save"] = None
    except Exception as error:  # reported for the test to read
        record["failed_save"] = f"{type(error).__name__}: {error}"
    if not is_chief(task_type, task_id):
        shutil.rmtree(os.path.dirname(own))
    strategy.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--saves", type=int, default=24)
    parser.add_argument("--chief-alone", action="store_true")
    parser.add_argument("--other-alone", action="store_true")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    options = mf.distribute.CommunicationOptions(timeout_seconds=args.timeout)
    strategy = mf.MultiWorkerMirroredStrategy(communication_options=options)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = rng.integers(0, 3, size=64)
    torch.manual_seed(0)
    with strategy.scope():
        model = mf.Model(_module())
        model.compile(mf.optimizers.SGD(learning_rate=0.1), mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=1, verbose=0)
    task_type, task_id = (strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id)
    record: dict = {"saves": [], "task": [task_type, task_id]}

    # 1. TensorFlow's tutorial, many times over.
    for i in range(args.saves):
        fmt = FORMATS[i % len(FORMATS)]
        model_path = os.path.join(args.out, NAMES[fmt])
        write_model_path = write_filepath(model_path, task_type, task_id)
        expected = model.get_weights()
        _save(model, fmt, write_model_path)
        if not is_chief(task_type, task_id):
            shutil.rmtree(os.path.dirname(write_model_path))  # tf.io.gfile.rmtree
        record["saves"].append(_what_loaded(fmt, model_path, expected))
        model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=1, verbose=0)  # other weights for the next

    # 2. The chief's save fails: every worker's call says so.
    if args.saves:
        _failed_save(strategy, model, args.out, task_type, task_id, record)

    # 3. PyTorch's habit (``--chief-alone``): the chief alone saves; the others read it after a barrier.
    if args.chief_alone:
        chief_alone = os.path.join(args.out, "chief-alone.keras")
        expected = model.get_weights()
        if is_chief(task_type, task_id):
            started = time.monotonic()
            for _ in range(3):
                model.save(chief_alone)
            record["chief_alone_seconds"] = time.monotonic() - started
        strategy.barrier()
        record["chief_alone"] = _what_loaded("keras", chief_alone, expected)
        model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=1, verbose=0)  # nobody waits for anyone
        strategy.barrier()

    # 4. ``--other-alone``: the other worker alone saves; the chief ends without saving.
    if args.other_alone and not is_chief(task_type, task_id):
        started = time.monotonic()
        try:
            model.save(os.path.join(args.out, "other-alone"))
            record["other_alone"] = None
        except Exception as error:  # reported for the test to read
            record["other_alone"] = f"{type(error).__name__}: {error}"
        record["other_alone_seconds"] = time.monotonic() - started
    with open(os.path.join(args.out, f"worker{task_id}.json"), "w") as f:
        json.dump(record, f)
    print(f"worker {task_id} done", flush=True)


if __name__ == "__main__":
    main()
