"""One worker of the multi-worker benchmarks; started under ``TF_CONFIG`` by bench_multiworker.py and
bench_backup.py (not meant to be run by hand, but it can be: see those scripts' printed commands).

Every worker interleaves the variants of its ``--mode`` in blocks of ``--steps`` steps; every block
starts and ends with ``dist.barrier()`` on the strategy's process group, and rank 0's wall time
between the two barriers is the block's time. Rank 0 writes all ranks' numbers to ``--out`` (JSON).

Modes:
  ddp     fit2w: ``fit`` under MultiWorkerMirroredStrategy on the global batch of 128;
          ddp2w: a hand-written loop, ``DistributedDataParallel`` on the same default process group,
                 each rank taking its 64 rows of the same global batches;
          fit1w: rank 0 alone runs ``fit`` of a one-device model on the same global batches of 128
                 while rank 1 waits at the closing barrier (idle: its CPU time is reported).
  accumulate  fitacc: ``fit`` under MultiWorkerMirroredStrategy with ``SGD(0.01,
          gradient_accumulation_steps=4)``, the global batch of 128 (an update every 4 batches);
          ddpacc: a hand-written DDP loop that accumulates the same way: 3 batches' ``backward`` of
                  ``loss / 4`` under ``ddp.no_sync()``, the 4th synced (one all-reduce per 4 batches),
                  ``step``, ``zero_grad``.
  backup  plain: ``fit`` without callbacks; sync: with ``BackupAndRestore(save_freq=30)``;
          async: with ``BackupAndRestore(save_freq=30, async_save=True)``; a fresh backup dir per
          block, ``delete_checkpoint=True`` (the deletion at the end of fit is part of the block).
          Every model first trains 15 steps untimed, so saves land mid-block (steps 15, 45 of 60).

All variants of a mode train their own copy of the same initial model on the same global batches
(block ``k`` of fit gets ``dataset.skip(k * steps)``), so the final weights must agree: printed.

``--batch-hook`` / ``--backup`` (mode ddp): fit's callbacks, see ``fit_callbacks``.

``--model``: ``cnn`` (default) the seed CNN with SGD 0.01 on the digits, global batch 128; ``mlp`` (mode
``ddp`` only) the tiny MLP of the per-step overhead measurements, 32-32-10 with Adam (learning rate 0.001,
epsilon 1e-7 in both loops) on 50,000 random examples, global batch 64 (32 per worker): a step that
is almost all framework. The hand-written loop's ``torch.optim.Adam`` is torch's default (not fused);
``fit``'s is fused, so the two loops' weights agree to rounding, not bitwise.
"""

from __future__ import annotations

import time

T_SCRIPT = time.time()

import argparse  # noqa: E402
import copy  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import meshfit as mf  # noqa: E402

ACCUMULATE = 4  # accumulate mode: batches per update


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("ddp", "backup", "accumulate"), required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-freq", type=int, default=30)
    parser.add_argument("--backup-base", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tune-malloc", action="store_true")
    parser.add_argument("--model", choices=("cnn", "mlp"), default="cnn")
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--batch-hook", action="store_true",
                        help="fit gets a callback with an empty on_train_batch_end (mode ddp)")
    parser.add_argument("--backup", action="store_true",
                        help="fit gets a BackupAndRestore(save_freq=10**9) in a fresh folder a block (mode ddp)")
    args = parser.parse_args()
    if args.model != "cnn" and args.mode != "ddp":
        parser.error(f"--model {args.model} is measured in --mode ddp only")
    tuned = C.tune_malloc() if args.tune_malloc else False
    C.quiet_threads()
    torch.manual_seed(0)

    strategy = mf.MultiWorkerMirroredStrategy()
    rank, world = strategy.replica_id, strategy.num_replicas_in_sync
    assert dist.is_initialized() and world > 1, "run me under TF_CONFIG with 2+ workers"
    work = C.workload(args.model)
    global_batch = work.global_batch
    local = global_batch // world

    x, y = work.x, work.y
    n = len(x)
    x_t, y_t = torch.from_numpy(x), torch.from_numpy(y)
    base = work.module
    dataset = mf.data.Dataset.from_tensor_slices((x, y)).shuffle(n, seed=0).repeat().batch(global_batch)
    blocks = args.rounds + 1

    # In backup mode every model first trains save_freq // 2 steps (no callback): the counter that
    # save_freq counts (loop_state.iterations) carries across fit calls, so the saves then fall in the
    # middle of blocks, as in a long run, not on a block's last step, where fit's end has to wait for
    # an async save to finish anyway.
    offset = args.save_freq // 2 if args.mode == "backup" else 0

    def block_data(k: int):
        start = offset + k * args.steps
        return dataset.skip(start)  # a fresh wrapper every block: its first pass (a re-iterated dataset reshuffles)

    def fit_model(distributed: bool, accumulate: int | None = None) -> mf.Model:
        if distributed:
            with strategy.scope():
                model = mf.Model(copy.deepcopy(base))
        else:  # one process alone: say so with a one-device scope (a model made outside every scope is
            # refused while a multi-replica strategy runs in the process)
            with mf.OneDeviceStrategy("cpu").scope():
                model = mf.Model(copy.deepcopy(base))
        work.compile(model, gradient_accumulation_steps=accumulate, steps_per_execution=args.steps_per_execution)
        return model

    def timed(run, only_rank0: bool = False):
        """Barrier, run (on every rank, or rank 0 only), barrier; per-step numbers."""
        dist.barrier()
        clock = C.Clock()
        if not only_rank0 or rank == 0:
            run()
        dist.barrier()
        return clock.per(args.steps)

    def rank_indices() -> list[torch.Tensor]:
        """This rank's rows of each global batch the hand-written loops read: fit's shuffle and order."""
        stream = mf.data.Dataset.from_tensor_slices(np.arange(n)).shuffle(n, seed=0).repeat().batch(global_batch)
        return [b[rank * local:(rank + 1) * local].clone() for b in itertools.islice(iter(stream), blocks * args.steps)]

    def fit_callbacks(alone: bool = False) -> list[mf.callbacks.Callback]:
        """With --batch-hook, a callback implementing on_train_batch_end (it may set stop_training, so the
        workers share the stop and preemption flags after every execution); with --backup, a
        BackupAndRestore that handles preemption and never saves inside a block (a fresh folder each,
        rank 0's; ``alone``: fit1w's, rank 0's own)."""
        callbacks: list[mf.callbacks.Callback] = []
        if args.batch_hook:
            callbacks.append(mf.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: None))
        if args.backup:
            folder = tempfile.mkdtemp(prefix="meshfit-mw-backup-") if rank == 0 else None
            if not alone:
                folder = strategy.broadcast_object(folder)
            callbacks.append(mf.callbacks.BackupAndRestore(folder, save_freq=10**9))
        return callbacks

    variants: dict[str, object] = {}
    models: dict[str, torch.nn.Module] = {}
    if args.mode == "ddp":
        fit2w = fit_model(True)
        count = {"fit2w": 0, "ddp2w": 0, "fit1w": 0}

        def run_fit2w():
            k = count["fit2w"]
            count["fit2w"] += 1
            fit2w.fit(block_data(k), steps_per_epoch=args.steps, epochs=1, verbose=0, callbacks=fit_callbacks())

        # The hand-written DDP loop, on the process group the strategy initialised.
        indices = rank_indices()
        ddp = DistributedDataParallel(copy.deepcopy(base))
        opt = work.hand_optimizer(ddp.parameters())

        def run_ddp2w():
            k = count["ddp2w"]
            count["ddp2w"] += 1
            for idx in indices[k * args.steps:(k + 1) * args.steps]:
                xb, yb = x_t[idx], y_t[idx]
                opt.zero_grad()
                loss = F.cross_entropy(ddp(xb), yb)
                loss.backward()
                opt.step()

        fit1w = fit_model(False) if rank == 0 else None

        def run_fit1w():
            k = count["fit1w"]
            count["fit1w"] += 1
            fit1w.fit(block_data(k), steps_per_epoch=args.steps, epochs=1, verbose=0,
                      callbacks=fit_callbacks(alone=True))

        variants = {"fit2w": lambda: timed(run_fit2w), "ddp2w": lambda: timed(run_ddp2w),
                    "fit1w": lambda: timed(run_fit1w, only_rank0=True)}
        models = {"fit2w": fit2w.module, "ddp2w": ddp.module}
        if fit1w is not None:
            models["fit1w"] = fit1w.module
    elif args.mode == "accumulate":
        fitacc = fit_model(True, ACCUMULATE)
        count = {"fitacc": 0, "ddpacc": 0}

        def run_fitacc():
            k = count["fitacc"]
            count["fitacc"] += 1
            fitacc.fit(block_data(k), steps_per_epoch=args.steps, epochs=1, verbose=0)

        indices = rank_indices()
        ddp = DistributedDataParallel(copy.deepcopy(base))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        done = [0]  # batches over the whole run: the windows go on across blocks, as fit's do

        def run_ddpacc():
            k = count["ddpacc"]
            count["ddpacc"] += 1
            for idx in indices[k * args.steps:(k + 1) * args.steps]:
                xb, yb = x_t[idx], y_t[idx]
                done[0] += 1
                if done[0] % ACCUMULATE:
                    with ddp.no_sync():
                        (F.cross_entropy(ddp(xb), yb) / ACCUMULATE).backward()
                    continue
                (F.cross_entropy(ddp(xb), yb) / ACCUMULATE).backward()
                opt.step()
                opt.zero_grad()

        variants = {"fitacc": lambda: timed(run_fitacc), "ddpacc": lambda: timed(run_ddpacc)}
        models = {"fitacc": fitacc.module, "ddpacc": ddp.module}
    else:
        base_dir = args.backup_base
        specs = {"plain": None, "sync": False, "async": True}
        run_models = {name: fit_model(True) for name in specs}
        count = dict.fromkeys(specs, 0)
        restored: list[str] = []

        def make_run(name: str, async_save: bool | None):
            def run():
                k = count[name]
                count[name] += 1
                callbacks = []
                if async_save is not None:
                    callback = mf.callbacks.BackupAndRestore(
                        os.path.join(base_dir, f"{name}-block{k}"), save_freq=args.save_freq,
                        delete_checkpoint=True, async_save=async_save)
                    callbacks.append(callback)
                run_models[name].fit(block_data(k), steps_per_epoch=args.steps, epochs=1, verbose=0,
                                     callbacks=callbacks)
                if callbacks and callbacks[0].restored_from is not None:
                    restored.append(callbacks[0].restored_from)
            return run

        def make_timed(run):
            return lambda: timed(run)

        variants = {name: make_timed(make_run(name, a)) for name, a in specs.items()}
        for model in run_models.values():
            if offset:  # a fresh wrapper each (a re-iterated dataset reshuffles: the models would differ)
                model.fit(dataset.skip(0), steps_per_epoch=offset, epochs=1, verbose=0)
        models = {name: m.module for name, m in run_models.items()}

    ready = time.time()
    times = C.interleave(variants, args.rounds)
    extra: dict[str, float] = {}
    if args.mode == "ddp":
        # For reading the scaling: one gloo all_reduce of a gradient-sized float32 tensor.
        grad = torch.ones(sum(p.numel() for p in base.parameters()))
        samples = []
        for _ in range(7):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(grad)
            samples.append((time.perf_counter() - start) * 1e3)
        extra = {"allreduce_ms": C.median(samples[1:]), "gradient_floats": grad.numel()}
    # Same-work check: every variant trained on the same global batches from the same weights.
    reference = next(iter(models.values()))
    diffs = {name: max((a - b).abs().max().item() for a, b in zip(reference.parameters(), m.parameters(), strict=True))
             for name, m in models.items()}
    mine = {"rank": rank, "times": times, "weight_diff_vs_" + next(iter(models)): diffs, "malloc_tuned": tuned,
            "script_start": T_SCRIPT, "ready": ready, "pid": os.getpid(), **extra}
    if args.mode == "backup":
        mine["restored"] = restored
        mine["leftover_backup_dirs"] = sorted(os.listdir(args.backup_base)) if rank == 0 else []
    everyone = strategy.all_gather_object(mine)
    if rank == 0:
        with open(args.out + ".tmp", "w") as f:
            json.dump({"ranks": everyone, "world": world, "mode": args.mode, "steps": args.steps,
                       "rounds": args.rounds, "model": args.model,
                       "global_batch": global_batch}, f)
        os.replace(args.out + ".tmp", args.out)
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main()
