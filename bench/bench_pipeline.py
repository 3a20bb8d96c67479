"""Pipeline parallelism: ``fit`` on ``[("pipe", 2)]`` against a hand-written ``torch.distributed.pipelining`` loop.

Model: bench_two_d.py's transformer LM (``--layers`` 4, ``--d-model`` 256, ``--heads`` 4, ``--vocab`` 1024,
``--seq`` 64), split at ``layers.<layers/2>`` into two stages, AdamW (lr 1e-3), float32, batch ``--batch``
(default 16) in ``--microbatches`` 4, schedule ``--schedule`` (1F1B). Variants, on the same batches:

- ``pipeline``: ``model.fit`` under ``LayoutMap(mesh).pipeline([...], microbatches, schedule)``, started as a user
  starts it (``meshfit launch --workers 2``);
- ``hand``: torch's own pipeline API as its tutorial writes it: ``pipeline(module, mb_args, split_spec)``,
  ``build_stage``, the same schedule class with the loss, ``torch.optim.AdamW`` over the stage's parameters,
  ``schedule.step`` then ``optimizer.step`` each batch, the last stage reading its loss (as ``fit`` logs it);
  2 processes with a torchrun-style environment, gloo.

Reported: rank 0's median ms per step after warm-up for each, and pipeline / hand (goal <= 1.05).

Run (figures from a loaded machine are noisy; say so):
  .venv/bin/python bench/bench_pipeline.py              # 1 round x 10 steps (+2 warm-up) per variant
  .venv/bin/python bench/bench_pipeline.py --rounds 3   # alternate the variants' order round by round
  .venv/bin/python bench/bench_pipeline.py --quick      # smoke run: a tiny model
  .venv/bin/python bench/bench_pipeline.py --timer epoch  # fit timed per epoch: no batch hook reading logs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
from bench_two_d import _data as lm_data  # noqa: E402  (the same model and batches as the 2-D bench)
from bench_two_d import _module as lm_module  # noqa: E402
from bench_two_d import _step_ms  # noqa: E402  (rank 0's median step after warm-up)

TARGET = 1.05
VARIANTS = ("pipeline", "hand")


def _split(args: argparse.Namespace) -> str:
    return f"layers.{args.layers // 2}"


def _pipeline_worker(args: argparse.Namespace) -> tuple[int, dict]:
    import torch.distributed as dist

    import meshfit as mf

    mesh = mf.dtensor.create_mesh([("pipe", 2)])
    layout_map = mf.dtensor.LayoutMap(mesh).pipeline([_split(args)], microbatches=args.microbatches,
                                                     schedule=args.schedule)
    with layout_map.scope():
        model = mf.Model(lm_module(args))
        model.compile(optimizer=mf.optimizers.AdamW(1e-3, weight_decay=0.004),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = lm_data(args)
    stamps: list[float] = []

    class StepTimer(mf.callbacks.Callback):
        def on_train_begin(self, logs=None):
            stamps.append(time.perf_counter())

        def on_train_batch_end(self, batch, logs=None):
            stamps.append(time.perf_counter())

    class EpochTimer(mf.callbacks.Callback):  # no batch hook: fit reduces no logs between steps
        def on_epoch_begin(self, epoch, logs=None):
            stamps.append(time.perf_counter())

        def on_epoch_end(self, epoch, logs=None):
            stamps.append(time.perf_counter())

    if args.timer == "step":
        model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0, callbacks=[StepTimer()])
    else:  # the second epoch's mean step, as the hand loop's steps after warm-up
        model.fit(x, y, batch_size=args.batch, epochs=2, shuffle=False, verbose=0, callbacks=[EpochTimer()])
        mean = (stamps[3] - stamps[2]) / (args.steps + args.warmup)
        stamps[:] = [mean * i for i in range(args.steps + args.warmup + 1)]
    optimizer = model.optimizer.torch_optimizer
    memory = {"params": 0, "held_params": 0, "grads_and_state": 0, "full": 0}
    for path, p in model.module.named_parameters():
        size = p.numel() * p.element_size()
        memory["params"] += p.untyped_storage().nbytes()  # what it keeps: another stage's is released (shape only)
        memory["full"] += 4 * size  # parameter, gradient and AdamW's two moments, one process's
        if model.residency.holds(path):
            memory["held_params"] += size
            state = [v for v in optimizer.state.get(p, {}).values() if hasattr(v, "dim") and v.dim() > 0]
            memory["grads_and_state"] += size + sum(v.numel() * v.element_size() for v in state)  # grad: as large
    return dist.get_rank(), {"steps": [b - a for a, b in zip(stamps, stamps[1:], strict=False)], **memory}


def _hand_worker(args: argparse.Namespace) -> tuple[int, dict]:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

    torch.set_num_threads(1)  # as meshfit launch gives each of 2 workers on this host
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    module = lm_module(args)
    x, y = (torch.from_numpy(a) for a in lm_data(args))
    vocab = args.vocab

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    micro = args.batch // args.microbatches
    pipe = pipeline(module, mb_args=(x[:micro],), split_spec={_split(args): SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    kind = ScheduleGPipe if args.schedule == "GPipe" else Schedule1F1B
    schedule = kind(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(stage.submod.parameters(), lr=1e-3, weight_decay=0.004)
    stamps = [time.perf_counter()]
    for step in range(args.steps + args.warmup):
        rows = slice(step * args.batch, (step + 1) * args.batch)
        optimizer.zero_grad(set_to_none=True)
        losses: list = []
        if rank == 0:
            schedule.step(x[rows])
        else:
            schedule.step(target=y[rows], losses=losses)
            float(torch.stack(losses).mean())  # fit reads the loss for its logs each step
        optimizer.step()
        stamps.append(time.perf_counter())
    dist.barrier()
    dist.destroy_process_group()
    return rank, {"steps": [b - a for a, b in zip(stamps, stamps[1:], strict=False)]}


def _worker_main(args: argparse.Namespace) -> None:
    rank, result = (_hand_worker if args.worker == "hand" else _pipeline_worker)(args)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _run(variant: str, args: argparse.Namespace, show: bool) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="meshfit-bench-pipeline-") as tmp:
        worker = [os.path.abspath(__file__), "--worker", variant, "--out", tmp] + [
            f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
            ("steps", "warmup", "layers", "d_model", "heads", "vocab", "seq", "batch", "microbatches", "schedule",
             "timer")]
        if variant == "pipeline":
            specs = [("meshfit launch", [C.python(), "-m", "meshfit._cli", "launch", "--workers", "2", *worker],
                      C.clean_env())]
            keys: tuple[str, ...] = ("OMP_NUM_THREADS",)
        else:
            port = str(C.free_ports(1)[0])
            specs = [(f"hand {r}", [C.python(), *worker], C.clean_env(
                RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for r in range(2)]
            keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
        if show:
            for _, argv, env in specs:
                print("command: " + C.command_line(argv, env, keys), flush=True)
        C.run_children(specs, timeout=args.timeout)
        return [C.read_json(os.path.join(tmp, f"rank{r}.json")) for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1F1B", choices=("GPipe", "1F1B"))
    parser.add_argument("--timer", default="step", choices=("step", "epoch"),
                        help="fit's steps timed by a callback at each batch's end (its logs reduced each step), "
                             "or as the second epoch's mean step (no batch hook)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--quick", action="store_true", help="a tiny model, 3 steps: checks that it works")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker_main(args)
        return
    if args.quick:
        args.layers, args.d_model, args.vocab, args.seq, args.steps, args.warmup = 2, 32, 64, 16, 3, 1
    print(f"bench_pipeline: transformer LM {args.layers} layers, d_model {args.d_model}, vocab {args.vocab}, seq "
          f"{args.seq}; AdamW; batch {args.batch} in {args.microbatches} microbatches, {args.schedule}; 2 stages on 2 "
          f"processes; {args.rounds} round(s) x {args.steps} steps (+{args.warmup} warm-up)", flush=True)
    results: dict[str, list[list[dict]]] = {v: [] for v in VARIANTS}
    for round_ in range(args.rounds):
        order = VARIANTS if round_ % 2 == 0 else tuple(reversed(VARIANTS))
        for variant in order:
            start = time.perf_counter()
            results[variant].append(_run(variant, args, show=round_ == 0))
            print(f"round {round_ + 1}, {variant}: {_step_ms(results[variant][-1], args.warmup):.1f} ms/step "
                  f"(run {time.perf_counter() - start:.0f} s)", flush=True)
    ms = {v: [_step_ms(r, args.warmup) for r in results[v]] for v in VARIANTS}
    ratio = C.median(C.ratios(ms["pipeline"], ms["hand"]))
    print(f"RESULT pipeline [wall] pipeline {C.median(ms['pipeline']):.1f} ms/step, hand {C.median(ms['hand']):.1f} "
          f"ms/step (rank 0, medians); pipeline/hand = {ratio:.3f}; target <= {TARGET}: {C.verdict(ratio, TARGET)}")
    for r, m in enumerate(results["pipeline"][-1]):
        trained = m["held_params"] + m["grads_and_state"]
        print(f"  pipeline process {r}: the stage it trains holds {trained:,d} B of parameters, gradients and AdamW "
              f"state = {trained / m['full']:.3f} of one process's {m['full']:,d} B; all it keeps (the other "
              f"stages' parameters released) {(m['params'] + m['grads_and_state']) / m['full']:.3f}")


if __name__ == "__main__":
    main()
