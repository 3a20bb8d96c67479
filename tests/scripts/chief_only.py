"""A worker script for the chief-only tests: train briefly, then call one Keras call on the chief alone.

Run under TF_CONFIG by ``tests/test_pytorch_habits.py``. ``--call`` picks ``save``, ``save_keras``,
``save_weights``, ``evaluate``, ``predict`` or ``all_save`` (every worker saves the same path);
``--sharded`` lays the weights out with ``LayoutMap.fully_sharded``. The chief writes what it got to
``<out>/chief.npz`` (outputs) and ``<out>/chief.json`` (numbers, timings, errors).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import numpy as np
import torch
from torch import nn

import meshfit as mf


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--call", required=True)
    parser.add_argument("--sharded", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    strategy = mf.MultiWorkerMirroredStrategy()
    task_id = strategy.cluster_resolver.task_id
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 6)).astype("float32")
    y = rng.integers(0, 3, size=40)
    torch.manual_seed(0)
    scope = (mf.dtensor.LayoutMap.fully_sharded(mf.dtensor.create_mesh([("batch", 2)])).scope()
             if args.sharded else contextlib.nullcontext())
    with strategy.scope(), scope:
        model = mf.Model(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))
        model.compile(mf.optimizers.SGD(learning_rate=0.1),
                      mf.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"])
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = os.path.join(args.out, "model.keras" if args.call == "save_keras" else "model")
    record: dict = {}
    if args.call == "all_save":
        model.save(path)
    elif task_id == 0:
        started = time.monotonic()
        try:
            if args.call in ("save", "save_keras"):
                model.save(path)
            elif args.call == "save_weights":
                model.save_weights(os.path.join(args.out, "weights.safetensors"))
            elif args.call == "evaluate":
                record["logs"] = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
            elif args.call == "predict":
                np.savez(os.path.join(args.out, "chief.npz"), predictions=model.predict(x, batch_size=8, verbose=0))
        except Exception as error:  # reported for the test to read
            record["error"] = f"{type(error).__name__}: {error}"
        record["seconds"] = time.monotonic() - started
    if task_id == 0:
        record["weights"] = [w.tolist() for w in model.get_weights()] if not args.sharded else None
        with open(os.path.join(args.out, "chief.json"), "w") as f:
            json.dump(record, f)
    print(f"worker {task_id} done", flush=True)
    if "error" in record:
        raise SystemExit(3)


if __name__ == "__main__":
    main()
