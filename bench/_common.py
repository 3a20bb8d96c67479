"""Shared pieces of the benchmarks: the seed CNN, the data, statistics, and process handling.

Every benchmark interleaves the variants it compares (A, B, A, B, ...) in one run and reports the
median of the per-round ratios: on a shared, noisy machine a slow period then hits both variants of a
round instead of one variant's whole run.

Process rules: every child starts in its own session (``start_new_session=True``), has a timeout, and
its whole process group is SIGKILLed in ``finally`` -- nothing outlives a benchmark.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from meshfit._runtime._launch import free_ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")

# The targets the benchmarks report against.
TARGET_FIT = 1.03          # fit / hand-written loop, one process
TARGET_MULTIWORKER = 1.05  # 2-worker fit / hand-written DDP loop
TARGET_BACKUP = 1.02       # fit with BackupAndRestore(save_freq=30) / without, its digest included


# ---- the model and data of the seed tutorial ------------------------------------------------
def seed_module():
    """The seed CNN, as ``shared/SPEC.md`` ports it (lazy ``LazyLinear``)."""
    from torch import nn

    return nn.Sequential(nn.Unflatten(1, (1, 28)), nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Flatten(),
                         nn.LazyLinear(128), nn.ReLU(), nn.Linear(128, 10))


def materialised_seed_module(sample_x):
    """The seed CNN with its lazy layer built by one forward pass on ``sample_x``."""
    import torch

    module = seed_module()
    with torch.no_grad():
        module(sample_x)
    return module


def load_train():
    """The training split of ``mf.datasets.load_digits(image_size=28)``: float32 images, int64 labels."""
    import meshfit as mf

    (x, y), _ = mf.datasets.load_digits(image_size=28)
    return x, y


def compile_seed(model, learning_rate: float = 0.01, gradient_accumulation_steps: int | None = None,
                 steps_per_execution: int = 1, jit_compile: bool | str = "auto") -> None:
    """What a user of the tutorial writes: SGD, sparse CE from logits, accuracy."""
    import meshfit as mf

    model.compile(optimizer=mf.optimizers.SGD(learning_rate=learning_rate,
                                              gradient_accumulation_steps=gradient_accumulation_steps),
                  loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  steps_per_execution=steps_per_execution, jit_compile=jit_compile)


@dataclasses.dataclass(frozen=True)
class Workload:
    """What a multi-worker benchmark trains: data, the initial module, the global batch, how ``fit``
    compiles it and the optimizer the hand-written loop builds on the same parameters."""

    x: Any
    y: Any
    module: Any
    global_batch: int
    compile: Any  # (model, gradient_accumulation_steps=None, steps_per_execution=1) -> None
    hand_optimizer: Any  # (parameters) -> torch.optim.Optimizer


TINY_MLP_EXAMPLES = 50_000


def workload(name: str) -> Workload:
    """``"cnn"``: the seed CNN on the digits, SGD 0.01, global batch 128. ``"mlp"``: the tiny MLP of the
    per-step overhead measurements (32-32-10, Adam 0.001 with Keras's epsilon 1e-7 in both loops,
    global batch 64, 50,000 random examples), where the step is almost all framework."""
    import numpy as np
    import torch
    from torch import nn

    import meshfit as mf

    if name == "cnn":
        x, y = load_train()
        return Workload(x, y, materialised_seed_module(torch.from_numpy(x[:2])), 128, compile_seed,
                        lambda params: torch.optim.SGD(params, lr=0.01))
    if name != "mlp":
        raise ValueError(f"Invalid workload: expected 'cnn' or 'mlp', received {name!r}.")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((TINY_MLP_EXAMPLES, 32)).astype("float32")
    y = rng.integers(0, 10, size=TINY_MLP_EXAMPLES).astype("int64")

    def compile_mlp(model: Any, gradient_accumulation_steps: int | None = None, steps_per_execution: int = 1) -> None:
        model.compile(optimizer=mf.optimizers.Adam(learning_rate=1e-3, epsilon=1e-7,
                                                   gradient_accumulation_steps=gradient_accumulation_steps),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                      steps_per_execution=steps_per_execution)

    return Workload(x, y, nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10)), 64, compile_mlp,
                    lambda params: torch.optim.Adam(params, lr=1e-3, eps=1e-7))


# ---- timing, statistics and printing -----------------------------------------------------------
class Clock:
    """Wall time, this process's CPU time (all its threads) and minor page faults since creation."""

    def __init__(self) -> None:
        self.faults = minor_faults()
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def per(self, count: int) -> tuple[float, float, float]:
        """(wall ms, CPU ms, minor faults) per unit of ``count``."""
        wall, cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
        return wall * 1e3 / count, cpu * 1e3 / count, (minor_faults() - self.faults) / count


def interleave(blocks: dict[str, Any], rounds: int, warmup: int = 1,
               on_round: Any = None) -> dict[str, dict[str, list[float]]]:
    """Run every ``blocks[name]()`` once per round, the order reversed every other round.

    Each block returns ``(wall, cpu, faults)`` per step (`Clock.per`). The first ``warmup`` rounds
    are dropped. Returns ``{"wall"|"cpu"|"faults": {name: [...]}}`` over the measured rounds.
    """
    names = list(blocks)
    kinds = ("wall", "cpu", "faults")
    out: dict[str, dict[str, list[float]]] = {k: {n: [] for n in names} for k in kinds}
    for r in range(warmup + rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            values = blocks[name]()
            if r >= warmup:
                for kind, value in zip(kinds, values, strict=True):
                    out[kind][name].append(value)
        if on_round is not None:
            on_round(r, r < warmup)
    return out


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    return [a / b for a, b in zip(numerator, denominator, strict=True)]


def verdict(ratio: float, target: float) -> str:
    return "PASS" if ratio <= target else "FAIL"


def spread(values: Sequence[float]) -> str:
    """``min..max`` of a list, for a feel of the noise."""
    return f"{min(values):.3f}..{max(values):.3f}" if values else "-"


def print_rounds(title: str, per_round: dict[str, Sequence[float]], ratio_of: tuple[str, ...] = (),
                 unit: str = "ms/step") -> None:
    """A table of one value per variant per measured round, plus ``a/b`` columns for pairs in ``ratio_of``."""
    names = list(per_round)
    pairs = [(ratio_of[i], ratio_of[i + 1]) for i in range(0, len(ratio_of), 2)]
    print(f"{title} ({unit}; ratio columns are per round)")
    print("round " + "".join(f"{n:>12s}" for n in names) + "".join(f"{a + '/' + b:>16s}" for a, b in pairs))
    for i in range(len(per_round[names[0]])):
        print(f"{i + 1:5d} " + "".join(f"{per_round[n][i]:12.3f}" for n in names)
              + "".join(f"{per_round[a][i] / per_round[b][i]:16.3f}" for a, b in pairs))


def summarize(times: dict[str, dict[str, list[float]]], numerator: str, denominator: str,
              target: float | None, label: str, unit: str = "ms/step") -> dict[str, float]:
    """Print medians and the median per-round ratio ``numerator/denominator``, for wall and CPU time."""
    result = {}
    for kind in ("wall", "cpu"):
        values = times[kind]
        per_round = ratios(values[numerator], values[denominator])
        ratio = median(per_round)
        result[kind] = ratio
        check = f"; target <= {target}: {verdict(ratio, target)}" if target is not None else ""
        print(f"RESULT {label} [{kind:4s}] {numerator} {median(values[numerator]):.3f} {unit}, "
              f"{denominator} {median(values[denominator]):.3f} {unit} (medians); "
              f"median ratio {numerator}/{denominator} = {ratio:.3f} (rounds {spread(per_round)}){check}")
    return result


def quiet_threads() -> None:
    """One intra-op thread, as the measurements use (and as ``meshfit launch`` sets)."""
    import torch

    torch.set_num_threads(1)


def tune_malloc() -> bool:
    """Make glibc keep freed memory: no per-step page faults that move between interleaved variants.

    With glibc's defaults the mmap threshold adapts and the heap top is trimmed, so the ~11 MB
    gradient of the seed CNN's big linear layer (freed and reallocated every step, ``set_to_none``)
    is at times handed back to the kernel and faulted in again: ~4000 minor faults (~8 ms) per step.
    Which of two interleaved variants pays depends on the other's allocations, not on the variant
    itself (measured: the same fit/hand pair read 0.98 in one run and 1.24 in another). A fixed
    32 MiB mmap threshold and no trimming remove that: after warm-up both variants fault ~0 times.
    Returns whether it was applied (glibc only).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 32 * 1024 * 1024)) and \
            bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False


def minor_faults() -> int:
    """Minor page faults of this process so far."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# ---- processes -------------------------------------------------------------------------------

def clean_env(**extra: str) -> dict[str, str]:
    """Our environment without any cluster settings, one thread per process, unbuffered output."""
    env = dict(os.environ)
    for key in ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE", "MESHFIT_MIRRORED_RANK", "MESHFIT_RESTART_COUNT", "SLURM_PROCID",
                "SLURM_NTASKS", "SLURM_JOB_ID"):
        env.pop(key, None)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", "")})
    env.update(extra)
    return env


def tf_config(ports: Sequence[int], index: int) -> str:
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})


def command_line(argv: Sequence[str], env: dict[str, str] | None = None, keys: Sequence[str] = ()) -> str:
    """A copy-pasteable shell line for ``argv`` with the env vars ``keys`` shown."""
    prefix = " ".join(f"{k}={shlex.quote(env[k])}" for k in keys if env and k in env)
    return (prefix + " " if prefix else "") + " ".join(shlex.quote(a) for a in argv)


class Child:
    """One child process in its own session; its output lines are collected with arrival times."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], name: str, echo: bool = False) -> None:
        self.name, self.echo = name, echo
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(list(argv), env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     bufsize=1, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"bench-read-{name}")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))
            if self.echo:
                print(f"[{self.name}] {line.rstrip()}", flush=True)

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def kill(self) -> None:
        """SIGKILL the child's whole process group (a no-op once it is gone) and reap it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._reader.join(timeout=5)


def run_children(children_spec: Sequence[tuple[str, Sequence[str], dict[str, str]]], timeout: float,
                 echo: bool = False, watch: Any = None) -> list[Child]:
    """Start ``(name, argv, env)`` children together, wait for all (or ``timeout``), kill every group.

    Raises ``RuntimeError`` with the children's output if one fails or the timeout passes; a failing
    child makes the others be killed at once rather than left waiting in a collective. ``watch``, if
    given, is called while waiting; a non-empty string it returns aborts the run with that reason
    (e.g. the machine running out of memory).
    """
    children: list[Child] = []
    try:
        for name, argv, env in children_spec:
            children.append(Child(argv, env, name, echo=echo))
        deadline = time.monotonic() + timeout
        while True:
            codes = [c.proc.poll() for c in children]
            if all(code == 0 for code in codes):
                break
            if any(code not in (None, 0) for code in codes):
                raise RuntimeError(_failure("a child failed", children))
            if time.monotonic() > deadline:
                raise RuntimeError(_failure(f"timed out after {timeout:.0f} s", children))
            reason = watch() if watch is not None else None
            if reason:
                raise RuntimeError(_failure(f"aborted: {reason}", children))
            time.sleep(0.05)
        return children
    finally:
        for child in children:
            child.kill()


def _failure(what: str, children: Sequence[Child]) -> str:
    parts = [f"benchmark {what}:"]
    for child in children:
        code = child.proc.poll()
        tail = "\n".join(line for _, line in child.lines[-40:])
        parts.append(f"--- {child.name} (exit code {code}) ---\n{tail}")
    return "\n".join(parts)


def run_mw_workers(mode: str, rounds: int, steps: int, extra: Sequence[str], timeout: float,
                   workers: int = 2) -> dict:
    """Run ``bench/_mw_worker.py --mode MODE`` on ``workers`` processes under ``TF_CONFIG``.

    Prints each worker's exact command; returns rank 0's JSON (every rank's numbers).
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="meshfit-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        ports = free_ports(workers)
        argv = [python(), os.path.join(BENCH, "_mw_worker.py"), "--mode", mode, "--rounds", str(rounds),
                "--steps", str(steps), "--out", out, *extra]
        if mode == "backup":
            argv += ["--backup-base", os.path.join(tmp, "backups")]
        specs = []
        for index in range(workers):
            env = clean_env(TF_CONFIG=tf_config(ports, index))
            specs.append((f"worker {index}", argv, env))
            print("command: " + command_line(argv, env, ("TF_CONFIG", "OMP_NUM_THREADS")), flush=True)
        run_children(specs, timeout=timeout)
        return read_json(out)


def python() -> str:
    return sys.executable


def read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


@dataclasses.dataclass(frozen=True)
class BackupCost:
    """A backup's cost measured inside one process (see `backup_cost`), in milliseconds."""

    save_extra_ms: float  # the median saving step's time after its batch end, beyond a quiet step's
    saves: int  # every save of the run, the last step's included
    writer_cpu_per_save_ms: float  # the writer thread's CPU time, all saves divided evenly
    quiet_step_ms: float  # the median step without a save
    save_freq: int

    @property
    def ratio(self) -> float:
        """1 + a save's cost ÷ the steps between two saves."""
        return 1 + (self.save_extra_ms + self.writer_cpu_per_save_ms) / (self.save_freq * self.quiet_step_ms)


def backup_cost(result: dict, save_freq: int) -> BackupCost:
    """The backup's cost measured inside one process, free of the spread between processes.

    A save runs in its step's batch end after every other callback: the time from the step clock's
    batch end to the next step's start, beyond the median of the steps without a save, is what the
    save cost the training thread. The writer thread's CPU time (all saves, divided evenly) is what
    the background write took from the cores the training threads share.
    """
    after_end, steps = result["after_end_ms"], result["step_ms"]
    saving = {k for k in range(len(after_end)) if (k + 1) % save_freq == 0}
    baseline = median([v for k, v in enumerate(after_end) if k not in saving])
    extra = median([after_end[k] - baseline for k in sorted(saving)])
    saves = (len(steps) + 1) // save_freq
    step = median([v for k, v in enumerate(steps) if k not in saving])
    return BackupCost(extra, saves, result["writer_cpu_ms"] / max(saves, 1), step, save_freq)


def accounted_ratio(result: dict, save_freq: int) -> float:
    """`backup_cost`'s ratio: 1 + (a save's extra time + its writer CPU) ÷ the quiet steps between saves."""
    return backup_cost(result, save_freq).ratio
