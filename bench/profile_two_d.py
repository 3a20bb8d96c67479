"""Where a 2-D ``fit`` step's time goes, next to the hand-written loop of ``bench_two_d.py``.

Runs the ``2d`` and ``hand`` variants of ``bench_two_d.py`` (same model, data and processes: ``meshfit
launch --workers 4`` for ``2d``, a torchrun-style environment for ``hand``), and in each process:

- CPU time per step (``time.process_time``: all the process's threads; ``time.thread_time``: the
  main thread) over ``--steps`` steps after ``--warmup``, without the profiler;
- then ``--profile-steps`` steps under ``torch.profiler`` (CPU): the count of each op and
  ``record_function`` region per step (aten ops, c10d collectives, ``aten::_local_scalar_dense`` host
  reads, FSDP regions), with DTensor's dispatches and redistributions counted from Python.

On a loaded machine compare the counts and the CPU time per process, not the wall time.

Run:
  .venv/bin/python bench/profile_two_d.py                 # 2d and hand, a table of the differences
  .venv/bin/python bench/profile_two_d.py --top 60        # more rows
  .venv/bin/python bench/profile_two_d.py --layer-blocks 0  # 2d on meshfit's default fully_shard units
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import bench_two_d as B  # noqa: E402


class _Probe:
    """CPU clocks over the measured steps, then the profiler over the profiled ones."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.counts: collections.Counter[str] = collections.Counter()
        self.cpu: list[float] = []
        self.thread: list[float] = []
        self.wall: list[float] = []
        self.profiler = None
        self.result: dict = {}
        self._patch()

    def _patch(self) -> None:
        """Count DTensor's op dispatches and redistributions (they are Python, not profiler ops)."""
        from torch.distributed.tensor import _api, _dispatch, _redistribute

        counts = self.counts
        original = _redistribute.redistribute_local_tensor

        def redistribute(*a, **k):
            counts["py: DTensor redistribute_local_tensor"] += 1
            return original(*a, **k)

        for module in (_api, _dispatch, _redistribute):
            module.redistribute_local_tensor = redistribute  # type: ignore[attr-defined]
        for name in ("_dispatch_fast_path_python_tail", "_propagate_op_sharding_dispatch_slow_path",
                     "_dispatch_get_local_results_slow_path"):
            setattr(_dispatch.OpDispatcher, name, _counted(counts, f"py: DTensor {name}",
                                                           getattr(_dispatch.OpDispatcher, name)))
        from_local = _api.DTensor.from_local

        def counted_from_local(*a, **k):
            counts["py: DTensor.from_local"] += 1
            return from_local(*a, **k)

        _api.DTensor.from_local = staticmethod(counted_from_local)  # type: ignore[method-assign]

    def after_step(self, index: int) -> None:
        """Called after step ``index`` (0-based) ends."""
        a = self.args
        now = (time.process_time(), time.thread_time(), time.perf_counter())
        if a.warmup - 1 <= index < a.warmup + a.steps - 1:
            self._last = now
        if a.warmup <= index < a.warmup + a.steps:
            self.cpu.append(now[0] - self._prev[0])
            self.thread.append(now[1] - self._prev[1])
            self.wall.append(now[2] - self._prev[2])
        self._prev = now
        if index == a.warmup + a.steps - 1:
            import torch

            self.counts.clear()
            self.profiler = _StackMode(a.stacks.split(",")) if a.stacks else \
                torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()
        if index == a.warmup + a.steps + a.profile_steps - 1 and self.profiler is not None:
            self.profiler.__exit__(None, None, None)

    def finish(self) -> dict:
        """The results (read after training: reading the profile holds the interpreter for seconds,
        which meshfit's heartbeat would take for a dead worker)."""
        a = self.args
        if a.stacks:
            self.result = {"cpu_ms": [1000 * c for c in self.cpu], "thread_ms": [1000 * c for c in self.thread],
                           "wall_ms": [1000 * c for c in self.wall],
                           "ops": {}, "stacks": {k: [(c / a.profile_steps, list(f)) for f, c in v.items()]
                                                 for k, v in self.profiler.seen.items()}}
            return self.result
        if True:
            ops = {e.key: e.count / a.profile_steps for e in self.profiler.key_averages()}
            py = {k: v / a.profile_steps for k, v in self.counts.items()}
            self.result = {"cpu_ms": [1000 * c for c in self.cpu], "thread_ms": [1000 * c for c in self.thread],
                           "wall_ms": [1000 * c for c in self.wall],
                           "ops": {**ops, **py}, "stacks": {}}
        return self.result



class _StackMode:
    """A dispatch mode recording the Python callers of the named ops (``--stacks``)."""

    def __init__(self, ops: list[str]) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        wanted = set(ops)
        seen: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.seen = seen

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func.name()).split(".")[0]
                if name in wanted:
                    import traceback

                    frames = tuple(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
                                   for f in traceback.extract_stack()[:-1]
                                   if "/torch/" not in f.filename or "/distributed/" in f.filename)
                    seen[name][frames[-10:]] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        return self.mode.__enter__()

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _data(args: argparse.Namespace):
    """``bench_two_d``'s batches, for the timed and the profiled steps."""
    return B._data(argparse.Namespace(**{**vars(args), "steps": args.steps + args.profile_steps}))


def _counted(counts, key, function):
    def counted(*a, **k):
        counts[key] += 1
        return function(*a, **k)

    return counted


def _meshfit_worker(args: argparse.Namespace) -> tuple[int, dict]:
    import torch.distributed as dist

    import meshfit as mf

    probe = _Probe(args)
    module = B._module(args)
    mesh = mf.dtensor.create_mesh([("batch", args.processes // args.model), ("model", args.model)])
    blocks = [f"layers.{i}" for i in range(args.layers)] if args.layer_blocks else None
    layout_map = mf.dtensor.LayoutMap.fully_sharded(mesh, blocks=blocks)
    for key, kind in B.KEYED.items():
        specs = ["model", mf.dtensor.UNSHARDED] if kind == "column" else [mf.dtensor.UNSHARDED, "model"]
        layout_map[key] = mf.dtensor.Layout(specs, mesh)
    with layout_map.scope():
        model = mf.Model(module)
        model.compile(optimizer=mf.optimizers.AdamW(1e-3),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(args)

    class Probe(mf.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            probe.after_step(batch)

    model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0, callbacks=[Probe()])
    return dist.get_rank(), probe.finish()


def _hand_worker(args: argparse.Namespace) -> tuple[int, dict]:
    import torch
    import torch.distributed as dist

    probe = _Probe(args)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    module, mesh = B.hand_parallelized(args, world)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.004)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = (torch.from_numpy(a) for a in _data(args))
    replicas, replica = world // args.model, mesh.get_local_rank("batch")
    per = args.batch // replicas
    for step in range(args.steps + args.warmup + args.profile_steps):
        start = step * args.batch + replica * per
        optimizer.zero_grad(set_to_none=True)
        logits = module(x[start:start + per])
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), y[start:start + per].reshape(-1))
        loss.backward()
        optimizer.step()
        float(loss)
        probe.after_step(step)
    dist.barrier()
    dist.destroy_process_group()
    return rank, probe.finish()


def _run(variant: str, args: argparse.Namespace) -> list[dict]:
    n = args.processes
    with tempfile.TemporaryDirectory(prefix="meshfit-profile-two-d-") as tmp:
        worker = [os.path.abspath(__file__), "--worker", variant, "--out", tmp] + [
            f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
            ("processes", "model", "steps", "warmup", "profile_steps", "stacks", "layer_blocks", "layers", "d_model", "heads", "vocab",
             "seq", "batch")]
        if variant == "2d":
            specs = [("meshfit launch", [C.python(), "-m", "meshfit._cli", "launch", "--workers", str(n), *worker],
                      C.clean_env())]
        else:
            port = str(C.free_ports(1)[0])
            specs = [(f"hand {r}", [C.python(), *worker], C.clean_env(
                RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for r in range(n)]
        C.run_children(specs, timeout=args.timeout)
        return [C.read_json(os.path.join(tmp, f"rank{r}.json")) for r in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--model", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="steps timed for CPU (no profiler)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--top", type=int, default=40, help="rows of the op table")
    parser.add_argument("--variants", default="2d,hand")
    parser.add_argument("--layer-blocks", type=int, default=1,
                        help="1 (default, as bench_two_d.py's --units hand): 2d names the layers as its fully_shard "
                             "blocks, as the hand loop shards them; 0: meshfit's default blocks (every direct child "
                             "holding weights)")
    parser.add_argument("--stacks", default="", help="comma-separated ops whose callers to print (rank 0)")
    parser.add_argument("--json", default=None, help="also write the per-rank results here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        rank, result = (_meshfit_worker if args.worker == "2d" else _hand_worker)(args)
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        return
    variants = args.variants.split(",")
    results = {v: _run(v, args) for v in variants}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    import statistics

    for v in variants:
        for op, rows in results[v][0]["stacks"].items():
            for count, frames in sorted(rows, key=lambda r: -r[0]):
                print(f"  [{v}] {op} x{count:g}:\n      " + "\n      ".join(reversed(frames)))

    print(f"profile_two_d: {args.processes} processes, mesh (batch {args.processes // args.model}, model "
          f"{args.model}); CPU over {args.steps} steps after {args.warmup}, ops over {args.profile_steps} steps "
          "(per step, rank 0 | max over ranks)")
    for v in variants:
        cpu = [statistics.median(r["cpu_ms"]) for r in results[v]]
        thread = [statistics.median(r["thread_ms"]) for r in results[v]]
        wall = statistics.median(results[v][0]["wall_ms"])
        print(f"  {v}: process CPU ms/step per rank {[round(c, 1) for c in cpu]}; main thread "
              f"{[round(c, 1) for c in thread]}; rank 0 wall {wall:.1f} ms/step (noisy)")
    if len(variants) == 2:
        a, b = (results[v][0]["ops"] for v in variants)
        keys = sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, 0) - b.get(k, 0)))
        print(f"  {'op / region':60s} {variants[0]:>9s} {variants[1]:>9s}")
        for k in keys[:args.top]:
            if a.get(k, 0) != b.get(k, 0):
                print(f"  {k[:60]:60s} {a.get(k, 0):9.1f} {b.get(k, 0):9.1f}")
        for label, pred in (("collectives (c10d::)", lambda k: k.startswith("c10d::")),
                            ("host reads (aten::_local_scalar_dense)", lambda k: k == "aten::_local_scalar_dense"),
                            ("aten ops", lambda k: k.startswith("aten::"))):
            print(f"  total {label}: " + ", ".join(
                f"{v} {sum(c for k, c in results[v][0]['ops'].items() if pred(k)):.0f}" for v in variants))


if __name__ == "__main__":
    main()
