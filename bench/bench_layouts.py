"""Layouts: memory per process and step time of a model sharded over ``model``, against replicas.

Model: a 2-layer MLP with 4096-wide hidden layers (``fc1`` 512→4096, ``fc2`` 4096→4096, ``head``
4096→10), Adam, global batch 64, float32. The sharded layout splits ``fc1`` by output features
(``["model", UNSHARDED]``, bias ``["model"]``) and ``fc2`` by input features (``[UNSHARDED, "model"]``);
``head`` and ``fc2.bias`` stay replicated.

Variants, each started as a user starts it (``meshfit launch --workers N``), interleaved round by
round in one run (order alternating per round):

- ``sharded-1x2`` / ``sharded-2x2``: mesh ``batch × model`` = (1, 2) / (2, 2) with the sharded layout;
- ``replicated-2`` / ``replicated-4``: the same model replicated on as many processes, mesh
  ``("batch", N)`` with an empty LayoutMap (every weight replicated: the DDP path);
- ``mwms-2``: ``MultiWorkerMirroredStrategy`` on 2 workers (the reference of the replicated mesh).

Reported: exact parameter + optimizer-state bytes per process (local shards) and the ratio sharded ÷
replicated; rank 0's median wall ms per step (``fit``, after warm-up steps) and the medians of the
per-round ratios sharded ÷ replicated (same process count) and replicated-2 ÷ mwms-2 (goal ≤ 1.05).

Run:  .venv/bin/python bench/bench_layouts.py [--rounds R] [--steps S]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = {"sharded-1x2": 2, "replicated-2": 2, "mwms-2": 2, "sharded-2x2": 4, "replicated-4": 4}
GLOBAL_BATCH, IN, HIDDEN, CLASSES = 64, 512, 4096, 10


def _worker(variant: str, steps: int, warmup: int, out: str) -> None:
    import numpy as np
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor

    import meshfit as mf

    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = nn.Sequential()
    module.add_module("fc1", nn.Linear(IN, HIDDEN))
    module.add_module("relu", nn.ReLU())
    module.add_module("fc2", nn.Linear(HIDDEN, HIDDEN))
    module.add_module("relu2", nn.ReLU())
    module.add_module("head", nn.Linear(HIDDEN, CLASSES))
    if variant == "mwms-2":
        scope = mf.MultiWorkerMirroredStrategy().scope()
    else:
        shape = {"sharded-1x2": (1, 2), "sharded-2x2": (2, 2)}.get(variant)
        dims = [("batch", shape[0]), ("model", shape[1])] if shape else [("batch", VARIANTS[variant])]
        mesh = mf.dtensor.create_mesh(dims)
        layout_map = mf.dtensor.LayoutMap(mesh)
        if shape:
            layout_map[r"^fc1\.weight$"] = mf.dtensor.Layout(["model", mf.dtensor.UNSHARDED], mesh)
            layout_map[r"^fc1\.bias$"] = mf.dtensor.Layout(["model"], mesh)
            layout_map[r"^fc2\.weight$"] = mf.dtensor.Layout([mf.dtensor.UNSHARDED, "model"], mesh)
        scope = layout_map.scope()
    with scope:
        model = mf.Model(module)
        model.compile(optimizer=mf.optimizers.Adam(1e-4), loss=mf.losses.SparseCategoricalCrossentropy(
            from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=((steps + warmup) * GLOBAL_BATCH, IN)).astype("float32")
    y = rng.integers(0, CLASSES, size=(len(x),)).astype("int64")
    stamps: list[float] = []

    class Timer(mf.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            stamps.append(time.perf_counter())

    start = time.perf_counter()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[Timer()])
    times = [b - a for a, b in zip(stamps[warmup - 1:], stamps[warmup:], strict=False)]

    def local_bytes(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = sum(local_bytes(p) for p in model.module.parameters())
    state = sum(local_bytes(v) for s in model.optimizer.torch_optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    rank = int(os.environ.get("RANK", "0"))
    import torch.distributed as dist

    if dist.is_initialized():
        rank = dist.get_rank()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_ms": 1000 * statistics.median(times), "param_bytes": params, "optimizer_bytes": state,
                       "total_s": time.perf_counter() - start}, f)


def _run(variant: str, steps: int, warmup: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        for key in ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        command = [sys.executable, "-m", "meshfit._cli", "launch", "--workers", str(VARIANTS[variant]),
                   os.path.abspath(__file__), "--worker", variant, "--steps", str(steps), "--warmup", str(warmup),
                   "--out", out]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{variant} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.steps, args.warmup, args.out)
        return
    print(f"bench_layouts: MLP {IN}-{HIDDEN}-{HIDDEN}-{CLASSES}, Adam, global batch {GLOBAL_BATCH}, "
          f"{args.rounds} rounds x {args.steps} steps (+{args.warmup} warm-up) per variant", flush=True)
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for round_ in range(args.rounds):
        order = list(VARIANTS) if round_ % 2 == 0 else list(reversed(VARIANTS))
        for variant in order:
            results[variant].append(_run(variant, args.steps, args.warmup, args.timeout))
        print(f"round {round_ + 1}: " + ", ".join(f"{v} {results[v][-1]['step_ms']:.0f} ms" for v in VARIANTS),
              flush=True)
    print("\nbytes per process (parameters + optimizer state, local shards; exact):")
    for variant in VARIANTS:
        r = results[variant][0]
        print(f"  {variant:13s} params {r['param_bytes']:>11,d}  optimizer {r['optimizer_bytes']:>11,d}  "
              f"total {r['param_bytes'] + r['optimizer_bytes']:>11,d}")
    for sharded, replicated in (("sharded-1x2", "replicated-2"), ("sharded-2x2", "replicated-4")):
        a, b = results[sharded][0], results[replicated][0]
        ratio = (a["param_bytes"] + a["optimizer_bytes"]) / (b["param_bytes"] + b["optimizer_bytes"])
        print(f"  {sharded} / {replicated}: {ratio:.4f}")
    print("\nstep time, rank 0, median ms (per-round ratios' median):")
    for variant in VARIANTS:
        print(f"  {variant:13s} {statistics.median(r['step_ms'] for r in results[variant]):8.1f} ms")
    for a, b in (("sharded-1x2", "replicated-2"), ("sharded-2x2", "replicated-4"), ("replicated-2", "mwms-2")):
        ratios = [x["step_ms"] / y["step_ms"] for x, y in zip(results[a], results[b], strict=True)]
        print(f"  {a} / {b}: {statistics.median(ratios):.3f}  (rounds: {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
