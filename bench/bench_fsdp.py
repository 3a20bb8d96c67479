"""Fully sharded data parallel: meshfit's ``LayoutMap.fully_sharded`` against a hand-written FSDP2 loop.

Model: an MLP of ``LAYERS`` blocks (``Linear(WIDTH, WIDTH)`` + ReLU) and a 10-class head, Adam,
global batch 64, float32, on 2 processes. Both variants shard each block with torch's
``fully_shard`` and then the root, and train on the same batches:

- ``meshfit``: ``model.fit`` under ``LayoutMap.fully_sharded(create_mesh([("batch", 2)]))``, started
  as a user starts it (``meshfit launch --workers 2``);
- ``hand``: ``fully_shard`` per block then the root, ``torch.optim.Adam``, forward / backward / step /
  ``zero_grad`` on each process's half of the global batch (``torchrun``-style env, gloo).

Reported: exact parameter + optimizer-state bytes per process (local shards) for each,
rank 0's median wall ms per step after warm-up, and the median of the per-round ratios meshfit ÷
hand (issue 21's goal: ≤ 1.10). Do not read figures from a loaded machine.

Run:  .venv/bin/python bench/bench_fsdp.py [--rounds R] [--steps S] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

PROCESSES, GLOBAL_BATCH, CLASSES = 2, 64, 10


def _module(width: int, layers: int):
    from torch import nn

    blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]
    return nn.Sequential(*blocks, nn.Linear(width, CLASSES))


def _data(steps: int, width: int):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * GLOBAL_BATCH, width)).astype("float32")
    y = rng.integers(0, CLASSES, size=(len(x),)).astype("int64")
    return x, y


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def _meshfit_worker(steps: int, warmup: int, width: int, layers: int) -> tuple[list[float], int]:
    import torch

    import meshfit as mf

    torch.manual_seed(0)
    mesh = mf.dtensor.create_mesh([("batch", PROCESSES)])
    with mf.dtensor.LayoutMap.fully_sharded(mesh).scope():
        model = mf.Model(_module(width, layers))
        model.compile(optimizer=mf.optimizers.Adam(1e-4),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(steps + warmup, width)
    stamps: list[float] = []

    class Timer(mf.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            stamps.append(time.perf_counter())

    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[Timer()])
    state = [v for s in model.optimizer.torch_optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return [b - a for a, b in zip(stamps[warmup - 1:], stamps[warmup:], strict=False)], \
        _local_bytes([*model.module.parameters(), *state])


def _hand_worker(steps: int, warmup: int, width: int, layers: int) -> tuple[list[float], int]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    module = _module(width, layers)
    mesh = init_device_mesh("cpu", (world,))
    for block in list(module)[:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = (torch.from_numpy(a) for a in _data(steps + warmup, width))
    per = GLOBAL_BATCH // world
    stamps: list[float] = []
    for step in range(steps + warmup):
        start = step * GLOBAL_BATCH + rank * per
        loss = loss_fn(module(x[start:start + per]), y[start:start + per])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss)  # fit reads the loss for its logs each step
        stamps.append(time.perf_counter())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    used = _local_bytes([*module.parameters(), *state])
    dist.destroy_process_group()
    return [b - a for a, b in zip(stamps[warmup - 1:], stamps[warmup:], strict=False)], used


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(variant: str, args: argparse.Namespace) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    for key in ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        worker = [os.path.abspath(__file__), "--worker", variant, "--out", out, "--steps", str(args.steps),
                  "--warmup", str(args.warmup), "--width", str(args.width), "--layers", str(args.layers)]
        if variant == "meshfit":
            procs = [subprocess.Popen([sys.executable, "-m", "meshfit._cli", "launch", "--workers", str(PROCESSES),
                                       *worker], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
        else:
            port = str(_free_port())
            procs = [subprocess.Popen([sys.executable, *worker], env=dict(
                env, RANK=str(r), WORLD_SIZE=str(PROCESSES), MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(PROCESSES)]
        try:
            outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode != 0 for p in procs) or not os.path.exists(out):
            raise RuntimeError(f"{variant} failed:\n" + "\n".join(o[-3000:] for o in outputs))
        with open(out) as f:
            return json.load(f)


def _worker_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    worker = _meshfit_worker if args.worker == "meshfit" else _hand_worker
    rank = int(os.environ.get("RANK", "0"))
    if args.worker == "meshfit":
        rank = -1
    times, used = worker(args.steps, args.warmup, args.width, args.layers)
    if rank == -1:
        rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"step_ms": 1000 * statistics.median(times), "bytes": used}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--quick", action="store_true", help="1 round, a small model: checks that it works")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker_main(args)
        return
    if args.quick:
        args.rounds, args.steps, args.warmup, args.width, args.layers = 1, 3, 2, 64, 3
    print(f"bench_fsdp: MLP {args.layers} x {args.width}, Adam, global batch {GLOBAL_BATCH}, {PROCESSES} processes, "
          f"{args.rounds} rounds x {args.steps} steps (+{args.warmup} warm-up)", flush=True)
    results: dict[str, list[dict]] = {"meshfit": [], "hand": []}
    for round_ in range(args.rounds):
        order = ["meshfit", "hand"] if round_ % 2 == 0 else ["hand", "meshfit"]
        for variant in order:
            results[variant].append(_run(variant, args))
        print(f"round {round_ + 1}: " + ", ".join(f"{v} {results[v][-1]['step_ms']:.1f} ms" for v in results),
              flush=True)
    for variant, runs in results.items():
        print(f"  {variant:8s} params + optimizer state per process {runs[0]['bytes']:>13,d} B, "
              f"step {statistics.median(r['step_ms'] for r in runs):8.1f} ms")
    ratios = [a["step_ms"] / b["step_ms"] for a, b in zip(results["meshfit"], results["hand"], strict=True)]
    print(f"  meshfit / hand: {statistics.median(ratios):.3f}  (rounds: {', '.join(f'{r:.3f}' for r in ratios)}; "
          "goal <= 1.10)")


if __name__ == "__main__":
    main()
