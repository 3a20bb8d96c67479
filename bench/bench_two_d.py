"""2-D parallelism: ``fit`` on ``[("batch", 2), ("model", 2)]`` against a hand-written torch 2-D loop.

Model: a small transformer LM (``--layers`` 4, ``--d-model`` 256, ``--heads`` 4, ``--vocab`` 1024,
``--seq`` 64; fused head-major qkv, ``F.scaled_dot_product_attention``, GELU MLP of 4 x d_model),
AdamW (lr 1e-3, weight decay 0.004), float32, global batch ``--batch`` (default 16), on 4 processes.
Variants, on the same batches:

- ``2d``: ``model.fit`` under ``LayoutMap.fully_sharded(mesh, blocks=["layers.0", ...])`` (the hand
  loop's ``fully_shard`` units: each block, then the root; ``--units default`` for meshfit's default
  units, each direct child with weights) with ``attn.qkv`` / ``mlp.fc1`` keyed
  ``["model", UNSHARDED]`` and ``attn.out`` / ``mlp.fc2`` keyed ``[UNSHARDED, "model"]``, started as a
  user starts it (``meshfit launch --workers 4``);
- ``hand``: ``init_device_mesh("cpu", (2, 2), ("batch", "model"))``, ``parallelize_module`` with
  ``ColwiseParallel`` / ``RowwiseParallel`` on the same four layers of each block, then ``fully_shard``
  per block over ``mesh["batch"]`` and on the root; ``torch.optim.AdamW``; zero_grad / forward /
  backward / step on the batch replica's rows; 4 processes with a torchrun-style environment, gloo;
- beside them: ``fsdp`` (``LayoutMap.fully_sharded`` on ``[("batch", 4)]``: sharded over batch only)
  and ``replicated`` (``MultiWorkerMirroredStrategy``: DDP on 4 processes).

Reported: rank 0's median ms per step after warm-up for each, the ratio 2d / hand (goal <= 1.05) and
2d / fsdp, 2d / replicated; for ``2d`` each process's bytes of parameters + gradients + AdamW state
(local shards), split into the weights keyed on ``model`` (goal <= 1/(B*M) of their replicated bytes
x 1.05) and the others (goal <= 1/B x 1.05).

Run (figures from a loaded machine are noisy; say so):
  .venv/bin/python bench/bench_two_d.py              # 1 round x 10 steps (+2 warm-up) per variant
  .venv/bin/python bench/bench_two_d.py --rounds 3   # alternate the variants' order round by round
  .venv/bin/python bench/bench_two_d.py --quick      # smoke run: a tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

TARGET_STEP, TARGET_MEMORY_SLACK = 1.05, 1.05
KEYED = {r"attn\.qkv\.weight": "column", r"attn\.out\.weight": "row", r"mlp\.fc1\.weight": "column",
         r"mlp\.fc2\.weight": "row"}
VARIANTS = ("2d", "hand", "fsdp", "replicated")


# ---- the model, the data and what a process measures -------------------------------------------
def _module(args: argparse.Namespace):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.head_dim = d // heads
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.out = nn.Linear(d, d)

        def forward(self, x):
            b, t, _ = x.shape
            qkv = self.qkv(x).view(b, t, -1, 3, self.head_dim)
            q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(y.transpose(1, 2).reshape(b, t, -1))

    class MLP(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x)))

    class Block(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn, self.mlp = Attention(d, heads), MLP(d)

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class TransformerLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(args.vocab, args.d_model)
            self.pos = nn.Parameter(torch.randn(args.seq, args.d_model) * 0.02)
            self.layers = nn.ModuleList(Block(args.d_model, args.heads) for _ in range(args.layers))
            self.norm = nn.LayerNorm(args.d_model)
            self.head = nn.Linear(args.d_model, args.vocab)

        def forward(self, tokens):
            x = self.embed(tokens) + self.pos[: tokens.shape[1]]
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    return TransformerLM()


def _data(args: argparse.Namespace):
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, size=((args.steps + args.warmup) * args.batch, args.seq + 1))
    return tokens[:, :-1].astype("int64"), tokens[:, 1:].astype("int64")


def _local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def _memory(module, optimizer) -> dict:
    """Bytes of parameters + gradients + optimizer state, keyed weights apart from the others, with their
    replicated (whole) figures."""
    out = {"keyed": 0, "keyed_full": 0, "other": 0, "other_full": 0}
    for path, p in module.named_parameters():
        kind = "keyed" if any(re.search(key, path) for key in KEYED) else "other"
        state = [v for v in optimizer.state.get(p, {}).values() if hasattr(v, "dim") and v.dim() > 0]
        out[kind] += _local_bytes(p) + (_local_bytes(p.grad) if p.grad is not None else 0) + \
            sum(_local_bytes(v) for v in state)
        out[kind + "_full"] += 4 * p.numel() * p.element_size()  # param + grad + 2 AdamW moments, whole
    return out


def _meshfit_worker(args: argparse.Namespace) -> tuple[int, dict]:
    import torch.distributed as dist

    import meshfit as mf

    module = _module(args)
    if args.worker == "replicated":
        scope = mf.distribute.MultiWorkerMirroredStrategy().scope()
    elif args.worker == "fsdp":
        scope = mf.dtensor.LayoutMap.fully_sharded(mf.dtensor.create_mesh([("batch", args.processes)])).scope()
    else:
        mesh = mf.dtensor.create_mesh([("batch", args.processes // args.model), ("model", args.model)])
        # `--units hand`: the hand loop's fully_shard units (each block, then the root: the same
        # collectives); `default`: meshfit's default units (each direct child with weights: embed, norm
        # and head too, 6 all-gathers and 3 reduce-scatters a step more here, less memory held).
        blocks = [f"layers.{i}" for i in range(args.layers)] if args.units == "hand" else None
        layout_map = mf.dtensor.LayoutMap.fully_sharded(mesh, blocks=blocks)
        for key, kind in KEYED.items():
            specs = ["model", mf.dtensor.UNSHARDED] if kind == "column" else [mf.dtensor.UNSHARDED, "model"]
            layout_map[key] = mf.dtensor.Layout(specs, mesh)
        scope = layout_map.scope()
    with scope:
        model = mf.Model(module)
        model.compile(optimizer=mf.optimizers.AdamW(1e-3),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(args)
    stamps: list[float] = []

    class Timer(mf.callbacks.Callback):
        def on_train_begin(self, logs=None):
            stamps.append(time.perf_counter())

        def on_train_batch_end(self, batch, logs=None):
            stamps.append(time.perf_counter())

    model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0, callbacks=[Timer()])
    steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    model.module.zero_grad(set_to_none=False)  # gradients of the size a step holds (fit frees them)
    memory = _memory(model.module, model.optimizer.torch_optimizer)
    return (dist.get_rank() if dist.is_initialized() else 0), {"steps": steps, **memory}


def hand_parallelized(args: argparse.Namespace, world: int) -> tuple[Any, Any]:
    """The hand loop's model and mesh: ``parallelize_module`` on each block's four layers over ``model``,
    then ``fully_shard`` per block and on the root over ``batch`` (also used by profile_two_d.py)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    module = _module(args)
    mesh = init_device_mesh("cpu", (world // args.model, args.model), mesh_dim_names=("batch", "model"))
    styles = {"attn.qkv": ColwiseParallel(), "attn.out": RowwiseParallel(), "mlp.fc1": ColwiseParallel(),
              "mlp.fc2": RowwiseParallel()}
    for block in module.layers:
        parallelize_module(block, mesh["model"], styles)
        fully_shard(block, mesh=mesh["batch"])
    fully_shard(module, mesh=mesh["batch"])
    return module, mesh


def _hand_worker(args: argparse.Namespace) -> tuple[int, dict]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    module, mesh = hand_parallelized(args, world)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.004)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = (torch.from_numpy(a) for a in _data(args))
    replicas, replica = world // args.model, mesh.get_local_rank("batch")
    per = args.batch // replicas
    stamps = [time.perf_counter()]
    for step in range(args.steps + args.warmup):
        start = step * args.batch + replica * per
        optimizer.zero_grad(set_to_none=True)
        logits = module(x[start:start + per])
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), y[start:start + per].reshape(-1))
        loss.backward()
        optimizer.step()
        float(loss)  # fit reads the loss for its logs each step
        stamps.append(time.perf_counter())
    dist.barrier()
    dist.destroy_process_group()
    return rank, {"steps": [b - a for a, b in zip(stamps, stamps[1:], strict=False)]}


def _worker_main(args: argparse.Namespace) -> None:
    rank, result = (_hand_worker if args.worker == "hand" else _meshfit_worker)(args)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


# ---- the parent ----------------------------------------------------------------------------------
def _run(variant: str, args: argparse.Namespace, show: bool) -> list[dict]:
    n = args.processes
    with tempfile.TemporaryDirectory(prefix="meshfit-bench-two-d-") as tmp:
        worker = [os.path.abspath(__file__), "--worker", variant, "--out", tmp, "--processes", str(n)] + [
            f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
            ("model", "steps", "warmup", "layers", "d_model", "heads", "vocab", "seq", "batch", "units")]
        if variant != "hand":
            specs = [("meshfit launch", [C.python(), "-m", "meshfit._cli", "launch", "--workers", str(n), *worker],
                      C.clean_env())]
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
        C.run_children(specs, timeout=args.timeout)
        return [C.read_json(os.path.join(tmp, f"rank{r}.json")) for r in range(n)]


def _step_ms(ranks: list[dict], warmup: int) -> float:
    return 1000 * statistics.median(ranks[0]["steps"][warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--model", type=int, default=2, help="size of the model axis (batch = processes / model)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--units", default="hand", choices=("hand", "default"),
                        help="2d's fully_shard units: the hand loop's (blocks=each layer; the same work) or "
                             "meshfit's default (every direct child with weights)")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 3 steps: checks that it works")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker_main(args)
        return
    if args.quick:
        args.layers, args.d_model, args.vocab, args.seq, args.steps, args.warmup = 2, 32, 64, 16, 3, 1
    batch = args.processes // args.model
    print(f"bench_two_d: transformer LM {args.layers} layers, d_model {args.d_model}, {args.heads} heads, vocab "
          f"{args.vocab}, seq {args.seq}; AdamW; global batch {args.batch}; {args.processes} processes, mesh "
          f"(batch {batch}, model {args.model}); {args.rounds} round(s) x {args.steps} steps (+{args.warmup} "
          "warm-up)", flush=True)
    results: dict[str, list[list[dict]]] = {v: [] for v in VARIANTS}
    for round_ in range(args.rounds):
        order = VARIANTS if round_ % 2 == 0 else tuple(reversed(VARIANTS))
        for variant in order:
            start = time.perf_counter()
            results[variant].append(_run(variant, args, show=round_ == 0))
            print(f"round {round_ + 1}, {variant}: {_step_ms(results[variant][-1], args.warmup):.1f} ms/step "
                  f"(run {time.perf_counter() - start:.0f} s)", flush=True)
    ms = {v: [_step_ms(r, args.warmup) for r in results[v]] for v in VARIANTS}
    ratio = C.median(C.ratios(ms["2d"], ms["hand"]))
    print(f"RESULT two_d [wall] 2d {C.median(ms['2d']):.1f} ms/step, hand {C.median(ms['hand']):.1f} ms/step "
          f"(rank 0, medians); 2d/hand = {ratio:.3f}; target <= {TARGET_STEP}: {C.verdict(ratio, TARGET_STEP)}")
    for other in ("fsdp", "replicated"):
        print(f"  2d/{other} = {C.median(C.ratios(ms['2d'], ms[other])):.3f} ({other} {C.median(ms[other]):.1f} "
              "ms/step)")
    for r, m in enumerate(results["2d"][-1]):
        keyed_goal = m["keyed_full"] / args.processes * TARGET_MEMORY_SLACK
        other_goal = m["other_full"] / batch * TARGET_MEMORY_SLACK
        print(f"  2d process {r}: keyed weights {m['keyed']:,d} B = {m['keyed'] / m['keyed_full']:.4f} of replicated "
              f"{m['keyed_full']:,d} B (goal <= 1/{args.processes} x {TARGET_MEMORY_SLACK}: "
              f"{C.verdict(m['keyed'], keyed_goal)}); others {m['other']:,d} B = {m['other'] / m['other_full']:.4f} "
              f"of {m['other_full']:,d} B (goal <= 1/{batch} x {TARGET_MEMORY_SLACK}: "
              f"{C.verdict(m['other'], other_goal)})")


if __name__ == "__main__":
    main()
