"""What proving replicas identical costs: the state digest, and VerifyReplicas in fit.

Issue targets:
  A. a digest of 100 M float32 parameters takes <= 3x one ``torch.sum`` over the same tensors, per
     process (this process, torch's default threads: as a user's process runs);
  B. ``VerifyReplicas(every_n_steps=100)`` costs <= 1 % of the seed CNN's 2-worker step time.

Part A holds 25 tensors of 4 M float32 (100 M parameters, 400 MB) and times, in interleaved rounds,
``sum``: ``t.sum()`` for each tensor, then one ``torch.stack(...).tolist()`` (the same single host
read the digest makes), and ``digest``: this process's part of every tensor's digest
(``meshfit.distribute.local_parts``, which `state_digest` and `verify_replicas` use). Reported: the
median per-round ratio digest / sum.

Part B starts 2 gloo workers (spawned here, file rendezvous, 1 thread each, as the tests do); each
trains the seed CNN (28x28 digits, global batch 128, SGD) with ``fit``. Per round, interleaved:
``plain`` (no callback) and ``verify`` (``VerifyReplicas(every_n_steps=100, on_divergence="stop")``),
``--steps`` steps each (default 200, so 2 checks a block); and one ``strategy.verify_replicas(model)``
timed alone (a check: digests of the weights and optimizer state, one all-gather). Reported: the
measured ratio verify / plain (noisy: a 1 % effect under a loaded machine), and the estimate
check time / (100 x step time).

Part C: backups with the digest included (every save compares the replicas' digests and records
the sum), one process: ``bench/_cnn_fit.py`` (the seed CNN, batch 64, ``--threads`` (2), epoch 1 a warm-up,
then 2 x ``--steps`` timed steps) without and with ``--backup-freq 30`` (``BackupAndRestore``'s
defaults: asynchronous saves), one fresh process per variant per round. Target <= 1.05. Fresh processes
of the same program differ by several per cent in step time, so each backup run also accounts its own
cost: 1 + (the median saving step's time after the step clock's batch end, beyond a quiet step's, plus
the writer thread's CPU time per save) / (30 x its median quiet step). The 2-worker
figure comes from ``bench/bench_backup.py --part A`` (target there <= 1.02 with the digest).

Run:  .venv/bin/python bench/bench_digest.py [--part A|B|C|ABC] [--rounds R] [--steps S] [--quick]
      [--layout replicated|fully_sharded]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

EVERY = 100
SAVE_FREQ = 30  # part C: BackupAndRestore(save_freq=30)


# ---- part A ------------------------------------------------------------------------------------
def part_a(rounds: int, parameters: int) -> None:
    import torch

    from meshfit.distribute import local_parts

    count = 25
    tensors = [torch.randn(parameters // count) for _ in range(count)]
    print(f"\n== part A: digest vs torch.sum over {parameters / 1e6:.0f} M float32 parameters ({count} tensors), "
          f"1 process, torch threads: {torch.get_num_threads()}; {rounds} rounds after 1 warm-up ==", flush=True)

    def block(fn):
        def run():
            clock = C.Clock()
            fn()
            return clock.per(1)
        return run

    times = C.interleave({
        "sum": block(lambda: torch.stack([t.sum() for t in tensors]).tolist()),
        "digest": block(lambda: local_parts(tensors, 0)),
    }, rounds)
    C.print_rounds("wall time per pass over the tensors", times["wall"], ratio_of=("digest", "sum"))
    ratio = C.median(C.ratios(times["wall"]["digest"], times["wall"]["sum"]))
    print(f"digest / sum: {ratio:.2f} (target <= 3) {C.verdict(ratio, 3.0)}", flush=True)


# ---- part B ------------------------------------------------------------------------------------
def _worker(rank: int, world: int, init_file: str, rounds: int, steps: int, queue, layout: str = "replicated") -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        queue.put((rank, _measure(rounds, steps, layout)))
    finally:
        dist.destroy_process_group()


def _measure(rounds: int, steps: int, layout: str = "replicated") -> dict:
    import numpy as np

    import meshfit as mf
    from meshfit.distribute._proof._one_copy import AtRest
    from meshfit.distribute._proof._verify import named_state, resolve_state

    if layout == "fully_sharded":  # every parameter shard in one copy: checked at rest and after gathering
        scope = mf.dtensor.LayoutMap.fully_sharded(mf.dtensor.create_mesh([("batch", 2)])).scope()
    else:
        scope = mf.MultiWorkerMirroredStrategy().scope()
    x, y = C.load_train()
    batch = 128
    rows = steps * batch
    x, y = np.resize(x, (rows, *x.shape[1:])), np.resize(y, rows)
    with scope:
        model = mf.Model(C.seed_module())
        C.compile_seed(model)
    strategy = model.strategy

    def fit(callbacks):
        def run():
            clock = C.Clock()
            model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
            return clock.per(steps)
        return run

    verify = mf.callbacks.VerifyReplicas(every_n_steps=EVERY, on_divergence="stop")
    times = C.interleave({"plain": fit([]), "verify": fit([verify])}, rounds)
    checks = []
    world = strategy.world
    for _ in range(10):  # what a check costs the callback: the comparison, and the at-rest record and re-check
        strategy.barrier()
        start = time.perf_counter()
        digest = strategy.verify_replicas(model)
        if digest.one_copy:
            record = AtRest.record(0, named_state(*resolve_state(model))[0], digest.one_copy, world.rank)
            world.all_gather_object(record.changed(named_state(*resolve_state(model))[0], world.rank))
        checks.append((time.perf_counter() - start) * 1e3)
    return {"times": times, "check_ms": C.median(checks), "checks": verify.checks,
            "parameters": sum(p.numel() for p in model.module.parameters())}


def part_b(rounds: int, steps: int, timeout: float, layout: str = "replicated") -> None:
    print(f"\n== part B: VerifyReplicas(every_n_steps={EVERY}) in fit, seed CNN {layout}, 2 workers x 1 thread, "
          f"global batch 128; {rounds} rounds x {steps} steps per variant after 1 warm-up round ==", flush=True)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, 2, os.path.join(tmp, "rendezvous"), rounds, steps, queue, layout),
                             daemon=True) for r in range(2)]
        for p in procs:
            p.start()
        try:
            results = dict(queue.get(timeout=timeout) for _ in procs)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    r0 = results[0]
    wall = r0["times"]["wall"]
    C.print_rounds("wall time per step, rank 0", wall, ratio_of=("verify", "plain"))
    measured = C.median(C.ratios(wall["verify"], wall["plain"]))
    step_ms = C.median(wall["plain"])
    estimate = r0["check_ms"] / (EVERY * step_ms)
    print(f"{r0['parameters']:,} parameters (+ SGD state); {r0['checks']} checks ran in the verify blocks")
    print(f"one check (verify_replicas alone, median of 10): {r0['check_ms']:.1f} ms; plain step {step_ms:.1f} ms")
    print(f"estimated cost: check / ({EVERY} steps) = {estimate * 100:.3f} % of the step time "
          f"(target <= 1 %) {C.verdict(1 + estimate, 1.01)}")
    print(f"measured verify / plain: {measured:.3f} (noise of a loaded machine included)", flush=True)


# ---- part C ------------------------------------------------------------------------------------
def part_c(rounds: int, steps: int, timeout: float, threads: int = 2) -> None:
    import subprocess

    print(f"\n== part C: BackupAndRestore(save_freq={SAVE_FREQ}) with the digest, 1 process x {threads} thread(s), seed CNN "
          "batch 64; "
          f"{rounds} rounds of fresh processes, 2 x {steps} timed steps each ==", flush=True)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_cnn_fit.py")
    wall: dict[str, list[float]] = {"plain": [], "backup": []}
    accounted: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = ["plain", "backup"] if r % 2 == 0 else ["backup", "plain"]
            for name in order:
                out = os.path.join(tmp, f"{name}-{r}.json")
                extra = ["--backup-freq", str(SAVE_FREQ), "--backup-dir", os.path.join(tmp, f"b{r}")] \
                    if name == "backup" else []
                subprocess.run([C.python(), script, "--steps", str(steps), "--threads", str(threads), "--out", out,
                                "--step-times", *extra], check=True,
                               timeout=timeout, env=C.clean_env())
                result = C.read_json(out)
                wall[name].append(result["ms_per_step"])
                if name == "backup":
                    accounted.append(C.accounted_ratio(result, SAVE_FREQ))
    C.print_rounds("wall time per step", wall, ratio_of=("backup", "plain"))
    ratio = C.median(C.ratios(wall["backup"], wall["plain"]))
    print(f"backup / plain: {ratio:.3f} (target <= 1.05) {C.verdict(ratio, 1.05)}", flush=True)
    print("accounted in the backup process itself, per round: 1 + (the saving step's extra time + the "
          f"writer thread's CPU per save) / ({SAVE_FREQ} x its median step): "
          + " ".join(f"{a:.3f}" for a in accounted)
          + f"; median {C.median(accounted):.3f} {C.verdict(C.median(accounted), 1.05)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="ABC", choices=["A", "B", "C", "AB", "ABC"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--parameters", type=int, default=100_000_000)
    parser.add_argument("--quick", action="store_true", help="1 round, 10 M parameters, 100 steps")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--threads", type=int, default=2, help="part C: torch threads of the one process")
    parser.add_argument("--layout", default="replicated", choices=["replicated", "fully_sharded"],
                        help="part B: data parallel, or LayoutMap.fully_sharded (one-copy checks)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.parameters, args.steps = 1, 10_000_000, 100
    print(f"cores {os.cpu_count()}, load average {os.getloadavg()[0]:.1f} at start", flush=True)
    if "A" in args.part:
        part_a(args.rounds, args.parameters)
    if "B" in args.part:
        part_b(args.rounds, args.steps, args.timeout, args.layout)
    if "C" in args.part:
        part_c(args.rounds, 60 if not args.quick else 30, args.timeout, args.threads)
    load = os.getloadavg()[0]
    print(f"load average {load:.1f} at end" + (" -- MEASURED UNDER LOAD" if load > (os.cpu_count() or 1) else ""))


if __name__ == "__main__":
    main()
