"""A worker script for the chief-only tests: train briefly, then call one Keras call on the chief alone.

Run under TF_CONFIG by ``tests/test_pytorch_habits.py``. ``--calls`` lists what the chief alone calls, in
order (``save``, ``save_keras``, ``save_weights``, ``evaluate``, ``predict``); ``--all-save`` then has
every worker save the same path; ``--sharded`` lays the weights out with ``LayoutMap.fully_sharded``.
The chief writes what it got to ``<out>/chief.npz`` (predictions, weights) and ``<out>/chief.json``
(evaluation, seconds per call, the first error).
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
    parser.add_argument("--calls", default="")
    parser.add_argument("--all-save", action="store_true")
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
    record: dict = {"seconds": {}}
    outputs: dict = {}
    if task_id == 0:
        for call in [c for c in args.calls.split(",") if c]:
            started = time.monotonic()
            try:
                if call == "save":
                    model.save(os.path.join(args.out, "model"))
                elif call == "save_keras":
                    model.save(os.path.join(args.out, "model.keras"))
                elif call == "save_weights":
                    model.save_weights(os.path.join(args.out, "weights.safetensors"))
                elif call == "evaluate":
                    record["logs"] = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
                elif call == "predict":
                    outputs["predictions"] = model.predict(x, batch_size=8, verbose=0)
            except Exception as error:  # reported for the test to read
                record["error"] = f"{type(error).__name__}: {error}"
                record["seconds"][call] = time.monotonic() - started
                break
            record["seconds"][call] = time.monotonic() - started
    if args.all_save:
        model.save(os.path.join(args.out, "shared"))
    if task_id == 0:
        if not args.sharded:
            outputs.update({f"w{i}": w for i, w in enumerate(model.get_weights())})
        np.savez(os.path.join(args.out, "chief.npz"), **outputs)
        with open(os.path.join(args.out, "chief.json"), "w") as f:
            json.dump(record, f)
    print(f"worker {task_id} done", flush=True)
    if "error" in record:
        raise SystemExit(3)


if __name__ == "__main__":
    main()
