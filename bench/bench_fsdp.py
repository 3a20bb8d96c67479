"""Fully sharded data parallel: ``LayoutMap.fully_sharded`` against a hand-written FSDP2 loop.

Model: an MLP of ``--layers`` blocks (``Linear(W, W)`` + ReLU, ``W = --width``) and a 10-class head,
Adam (lr 1e-4), float32. Two variants, on the same batches:

- ``meshfit``: ``model.fit`` under ``LayoutMap.fully_sharded(create_mesh([("batch", N)]))``, started
  as a user starts it (``meshfit launch --workers N``);
- ``hand``: ``fully_shard`` per block then on the root, ``torch.optim.Adam``, ``zero_grad`` /
  forward / backward / step on each process's slice of the global batch, N processes started with a
  torchrun-style environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
  ``OMP_NUM_THREADS=1``), gloo.

Default mode (the step-time comparison): for each N of ``--processes`` (default: 2 and 4, in one
run), the variants alternate round by round (A, B / B, A ...); reported per N: rank 0's median ms per
step after warm-up, the median of the per-round ratios meshfit ÷ hand (goal ≤ 1.10), and for every
process its bytes of parameters + gradients + Adam state (``exp_avg``, ``exp_avg_sq``; the scalar
``step`` counters left out) read from its local shards after the last step, against the replicated
figure (the same three for the whole model, ``4 × parameter bytes``; goal ≤ replicated / N × 1.05),
with its peak RSS (``ru_maxrss`` and ``VmHWM``) and its RSS once the model is built and sharded.

``--big``: a model whose replicated training state on 4 processes exceeds this machine's RAM
(default 36 blocks of 4096 × 4096: 604 M parameters, 9.7 GB of parameters + gradients + Adam state
per replica). The replicated run is not started: the arithmetic against ``MemTotal`` is printed and it
is skipped (it would exhaust the machine). The sharded run trains ``--steps`` steps (default 2, after
1 warm-up) on 4 processes under ``meshfit launch``, 8 rows per process, and prints each step's time,
each process's bytes and peak RSS. meshfit builds the whole model in every process before sharding
it (``mf.Model(module)`` takes a materialised module: one full copy of the parameters, 2.4 GB, per
process while building, freed once sharded); at N = 4 that copy is as large as the sharded training
state, so the peak RSS (~3.1 GiB a process, measured) comes from training either way. The run is
aborted if the machine's ``MemAvailable`` falls under ``--min-free-gib`` (default 4). With ``--meta``
meshfit's model is built under ``torch.device("meta")`` and ``LayoutMap.fully_sharded`` materialises
and shards it one block at a time, so no process ever holds the whole model (the hand loop, in the
default mode, builds it eagerly either way).

Wall time (2 cores, measured under load, niced): ``--quick`` 1.5 min; ``--big`` 5.3 min (~90 s a
step); the default mode ~1.6 s a step at N = 2 and ~2.4 s at N = 4, so 5 rounds ~13 min.

Run (do not read figures from a loaded machine):
  .venv/bin/python bench/bench_fsdp.py                      # N = 2 and 4, 5 rounds x 10 steps
  .venv/bin/python bench/bench_fsdp.py --processes 2        # one N only
  .venv/bin/python bench/bench_fsdp.py --big                # 604 M parameters, sharded on 4 processes
  .venv/bin/python bench/bench_fsdp.py --big --meta         # the same, built on the meta device
  .venv/bin/python bench/bench_fsdp.py --quick              # smoke run: tiny model, 1 round, N = 2 and 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

CLASSES, TARGET_STEP, TARGET_MEMORY_SLACK = 10, 1.10, 1.05
GIB = 1 << 30


# ---- the model, the data and what a process measures -------------------------------------------
def _module(width: int, layers: int):
    from torch import nn

    blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]
    return nn.Sequential(*blocks, nn.Linear(width, CLASSES))


def _param_count(width: int, layers: int) -> int:
    return layers * (width * width + width) + width * CLASSES + CLASSES


def _data(steps: int, width: int, global_batch: int):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * global_batch, width)).astype("float32")
    y = rng.integers(0, CLASSES, size=(len(x),)).astype("int64")
    return x, y


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def _memory(params, optimizer) -> dict:
    """This process's bytes of parameters, gradients and optimizer state (local shards), and its RSS."""
    import torch

    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": _local_bytes(params), "grads": _local_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": _local_bytes(state), **_rss()}


def _rss() -> dict:
    import resource

    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                status[key] = int(value.split()[0]) * 1024
    return {"ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "vmhwm": status.get("VmHWM", 0), "vmrss": status.get("VmRSS", 0)}


def _meshfit_worker(args: argparse.Namespace) -> tuple[int, dict]:
    import torch
    import torch.distributed as dist

    import meshfit as mf

    begin = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("meta") if args.meta else contextlib.nullcontext():
        module = _module(args.width, args.layers)
    full = _local_bytes(module.parameters())
    _progress(args, f"built the {'meta' if args.meta else 'full'} module in {time.perf_counter() - begin:.1f} s, RSS {_rss()['vmrss'] / 2**20:,.0f} MiB")
    mesh = mf.dtensor.create_mesh([("batch", args.processes)])
    with mf.dtensor.LayoutMap.fully_sharded(mesh).scope():
        model = mf.Model(module)
        model.compile(optimizer=mf.optimizers.Adam(1e-4),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    built = _rss()["vmrss"]
    _progress(args, f"sharded, {time.perf_counter() - begin:.1f} s since start, RSS {built / 2**20:,.0f} MiB")
    x, y = _data(args.steps + args.warmup, args.width, args.batch)
    stamps: list[float] = []

    class Timer(mf.callbacks.Callback):
        def on_train_begin(self, logs=None):
            stamps.append(time.perf_counter())

        def on_train_batch_end(self, batch, logs=None):
            stamps.append(time.perf_counter())
            _progress(args, f"step {len(stamps) - 1}: {stamps[-1] - stamps[-2]:.2f} s, RSS {_rss()['vmrss'] / 2**20:,.0f} MiB")

    model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0, callbacks=[Timer()])
    memory = _memory(list(model.module.parameters()), model.optimizer.torch_optimizer)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, {"steps": [b - a for a, b in zip(stamps, stamps[1:], strict=False)], "full_params": full,
                  "rss_built": built, **memory}


def _hand_worker(args: argparse.Namespace) -> tuple[int, dict]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    module = _module(args.width, args.layers)
    full = _local_bytes(module.parameters())
    mesh = init_device_mesh("cpu", (world,))
    for block in list(module)[:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    built = _rss()["vmrss"]
    x, y = (torch.from_numpy(a) for a in _data(args.steps + args.warmup, args.width, args.batch))
    per = args.batch // world
    stamps = [time.perf_counter()]
    for step in range(args.steps + args.warmup):
        start = step * args.batch + rank * per
        optimizer.zero_grad(set_to_none=True)  # where fit's train_step zeroes them
        loss = loss_fn(module(x[start:start + per]), y[start:start + per])
        loss.backward()
        optimizer.step()
        float(loss)  # fit reads the loss for its logs each step
        stamps.append(time.perf_counter())
    memory = _memory(list(module.parameters()), optimizer)
    dist.barrier()
    dist.destroy_process_group()
    return rank, {"steps": [b - a for a, b in zip(stamps, stamps[1:], strict=False)], "full_params": full,
                  "rss_built": built, **memory}


def _progress(args: argparse.Namespace, line: str) -> None:
    """``--big``: a progress line from each process (``meshfit launch`` prefixes its worker number)."""
    if args.progress:
        print(line, flush=True)


def _worker_main(args: argparse.Namespace) -> None:
    rank, result = (_meshfit_worker if args.worker == "meshfit" else _hand_worker)(args)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


# ---- the parent ----------------------------------------------------------------------------------
def _meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = int(value.split()[0]) * 1024
    return out


def _memory_watch(min_free: float):
    def watch() -> str | None:
        available = _meminfo()["MemAvailable"]
        return f"MemAvailable {available / GIB:.1f} GiB < {min_free / GIB:.1f} GiB" if available < min_free else None
    return watch


def _run(variant: str, n: int, args: argparse.Namespace, show: bool, watch=None) -> list[dict]:
    """One run of ``variant`` on ``n`` processes; every rank's result, by rank."""
    with tempfile.TemporaryDirectory(prefix="meshfit-bench-fsdp-") as tmp:
        worker = [os.path.abspath(__file__), "--worker", variant, "--out", tmp, "--processes", str(n),
                  "--steps", str(args.steps), "--warmup", str(args.warmup), "--width", str(args.width),
                  "--layers", str(args.layers), "--batch", str(args.batch), *(["--progress"] if watch else []),
                  *(["--meta"] if args.meta else [])]
        if variant == "meshfit":
            argv = [C.python(), "-m", "meshfit._cli", "launch", "--workers", str(n), *worker]
            specs = [("meshfit launch", argv, C.clean_env())]
            keys: tuple[str, ...] = ("OMP_NUM_THREADS",)
        else:
            port = str(C.free_ports(1)[0])
            specs = [(f"hand {r}", [C.python(), *worker], C.clean_env(
                RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for r in range(n)]
            keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
        if show:
            for _, argv, env in specs:
                print("command: " + C.command_line(argv, env, keys), flush=True)
        C.run_children(specs, timeout=args.timeout, echo=watch is not None, watch=watch)
        return [C.read_json(os.path.join(tmp, f"rank{r}.json")) for r in range(n)]


def _step_ms(ranks: list[dict], warmup: int) -> float:
    return 1000 * statistics.median(ranks[0]["steps"][warmup:])


def _print_memory(label: str, ranks: list[dict]) -> None:
    n = len(ranks)
    replicated = 4 * ranks[0]["full_params"]  # parameters + gradients + exp_avg + exp_avg_sq, whole model
    goal = replicated / n * TARGET_MEMORY_SLACK
    print(f"  {label}: replicated figure (params + grads + Adam state of the whole model) {replicated:,d} B; "
          f"goal <= replicated / {n} x {TARGET_MEMORY_SLACK} = {goal:,.0f} B")
    for r, m in enumerate(ranks):
        total = m["params"] + m["grads"] + m["optimizer"]
        print(f"    process {r}: params {m['params']:,d} + grads {m['grads']:,d} + Adam {m['optimizer']:,d} = "
              f"{total:,d} B = {total / replicated:.4f} of replicated ({C.verdict(total, goal)}); peak RSS "
              f"{m['vmhwm'] / 2**20:,.0f} MiB (VmHWM; ru_maxrss {m['ru_maxrss'] / 2**20:,.0f} MiB), RSS once "
              f"built and sharded {m['rss_built'] / 2**20:,.0f} MiB")


def _compare(args: argparse.Namespace) -> None:
    print(f"bench_fsdp: MLP {args.layers} x {args.width} (+ head), {_param_count(args.width, args.layers):,d} "
          f"parameters, Adam, global batch {args.batch}, processes {args.processes}, {args.rounds} rounds x "
          f"{args.steps} steps (+{args.warmup} warm-up)", flush=True)
    results = {(v, n): [] for n in args.processes for v in ("meshfit", "hand")}
    for round_ in range(args.rounds):
        for n in args.processes:
            order = ["meshfit", "hand"] if round_ % 2 == 0 else ["hand", "meshfit"]
            for variant in order:
                start = time.perf_counter()
                results[variant, n].append(_run(variant, n, args, show=round_ == 0))
                print(f"round {round_ + 1}, N={n}, {variant}: {_step_ms(results[variant, n][-1], args.warmup):.1f} "
                      f"ms/step (run {time.perf_counter() - start:.0f} s)", flush=True)
    for n in args.processes:
        mf_ms = [_step_ms(r, args.warmup) for r in results["meshfit", n]]
        hand_ms = [_step_ms(r, args.warmup) for r in results["hand", n]]
        ratios = C.ratios(mf_ms, hand_ms)
        ratio = C.median(ratios)
        print(f"\nN={n}:")
        print(f"RESULT fsdp N={n} [wall] meshfit {C.median(mf_ms):.1f} ms/step, hand {C.median(hand_ms):.1f} "
              f"ms/step (rank 0, medians); median ratio meshfit/hand = {ratio:.3f} (rounds "
              f"{', '.join(f'{r:.3f}' for r in ratios)}); target <= {TARGET_STEP}: {C.verdict(ratio, TARGET_STEP)}")
        for variant in ("meshfit", "hand"):
            _print_memory(variant, results[variant, n][-1])


def _big(args: argparse.Namespace) -> None:
    n = args.processes[0] if len(args.processes) == 1 else 4
    params = _param_count(args.width, args.layers)
    per_replica = 16 * params  # fp32 parameters + gradients + Adam's exp_avg and exp_avg_sq
    info = _meminfo()
    print(f"bench_fsdp --big: MLP {args.layers} x {args.width} (+ head): {params:,d} parameters, Adam, float32, "
          f"{args.batch // n} rows per process (global batch {args.batch}), {n} processes, {args.warmup} warm-up "
          f"+ {args.steps} steps", flush=True)
    print(f"replicated: {params:,d} parameters x 16 B (parameter + gradient + 2 Adam moments) = "
          f"{per_replica / 1e9:.2f} GB per replica; x {n} processes = {n * per_replica / 1e9:.2f} GB "
          f"({n * per_replica / GIB:.1f} GiB) against this machine's MemTotal {info['MemTotal'] / GIB:.1f} GiB")
    if n * per_replica > info["MemTotal"]:
        print("replicated: SKIPPED, it cannot fit in this machine's memory (starting it would exhaust the "
              "machine for every process on it)")
    else:
        print("replicated: it would fit in MemTotal here; not run by --big (the default mode compares)")
    # meshfit materialises the whole module in each process before sharding it (one full copy of the
    # parameters, freed once sharded), then holds 1/N of parameters + gradients + Adam state, plus the
    # interpreter and torch (~0.3 GiB) and a few gathered blocks in flight.
    need = n * ((per_replica / n if args.meta else max(4 * params, per_replica / n)) + GIB)
    min_free = args.min_free_gib * GIB
    built = "built on the meta device, sharded block by block: 1/{n}" if args.meta else \
        "the larger of one full copy of the parameters while building and 1/{n}"
    print(f"sharded: estimated peak {need / GIB:.1f} GiB for the {n} processes (each {built.format(n=n)} of the "
          f"training state, + 1 GiB); MemAvailable now "
          f"{info['MemAvailable'] / GIB:.1f} GiB; aborted if it falls under {args.min_free_gib} GiB", flush=True)
    if info["MemAvailable"] - need < min_free:
        raise SystemExit(f"Not started: MemAvailable {info['MemAvailable'] / GIB:.1f} GiB minus the estimated "
                         f"{need / GIB:.1f} GiB leaves less than --min-free-gib {args.min_free_gib} GiB. Free "
                         "memory, or pass a smaller --layers/--width.")
    start = time.perf_counter()
    ranks = _run("meshfit", n, args, show=True, watch=_memory_watch(min_free))
    print(f"sharded on {n} processes under meshfit launch: trained; whole run {time.perf_counter() - start:.0f} s")
    print("  rank 0 step times: " + ", ".join(
        f"{'warm-up' if i < args.warmup else 'step'} {i + 1} {s:.2f} s" for i, s in enumerate(ranks[0]["steps"])))
    _print_memory("meshfit", ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, action="append", default=None,
                        help="process count N (repeatable; default 2 and 4, --big: 4)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 10; --big: 2)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per run (default 2; --big: 1)")
    parser.add_argument("--width", type=int, default=None, help="block width (default 2048; --big: 4096)")
    parser.add_argument("--layers", type=int, default=None, help="blocks (default 8; --big: 36)")
    parser.add_argument("--batch", type=int, default=None, help="global batch (default 64; --big: 8 per process)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per run (default 900; --big: 3600)")
    parser.add_argument("--min-free-gib", type=float, default=4.0, help="--big: abort under this MemAvailable")
    parser.add_argument("--meta", action="store_true",
                        help="meshfit builds the model on the meta device (sharded block by block, never whole)")
    parser.add_argument("--quick", action="store_true", help="1 round, a tiny model: checks that it works")
    parser.add_argument("--big", action="store_true", help="a 604 M-parameter model, sharded on 4 processes")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--progress", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.processes = args.processes[0]
        _worker_main(args)
        return
    if args.big:
        defaults = {"steps": 2, "warmup": 1, "width": 4096, "layers": 36, "timeout": 3600, "processes": [4]}
    elif args.quick:
        defaults = {"steps": 3, "warmup": 2, "width": 64, "layers": 3, "timeout": 300, "batch": 64}
        args.rounds = 1
    else:
        defaults = {"steps": 10, "warmup": 2, "width": 2048, "layers": 8, "timeout": 900, "batch": 64}
    for key, value in {"processes": [2, 4], **defaults}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.batch is None:  # --big: 8 rows per process
        args.batch = 8 * (args.processes[0] if len(args.processes) == 1 else 4)
    if args.big:
        _big(args)
    else:
        _compare(args)


if __name__ == "__main__":
    main()
