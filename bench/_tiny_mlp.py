"""The tiny MLP of the per-step overhead measurements, one process: ``fit`` or a hand-written loop.

A process of ``bench_tiny_mlp.py``, started as a user starts a script. The model is 32-32-10 (ReLU),
Adam (learning rate 0.001, epsilon 1e-7), batch 32, 50,000 random examples, one torch thread. Both
variants take the same batch order (the same shuffled index order each epoch, made before timing)
and start from the same weights, so both do the same arithmetic.

- ``hand``: ``xb, yb = x[idx], y[idx]; opt.zero_grad(); loss = F.cross_entropy(model(xb), yb);
  loss.backward(); opt.step(); total += loss.item()`` (the loop reads its loss every step, as a
  hand-written loop that prints its progress does), torch's own ``torch.optim.Adam`` with its defaults
  (``hand-fused``: ``fused=True``, the implementation ``fit``'s Adam takes).
- ``fit``: ``model.compile(Adam, SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])``
  then ``model.fit(dataset, epochs=E)`` with its default ``verbose`` (its output goes to a pipe, so the bar
  prints a line an epoch), the dataset ``Dataset.from_tensor_slices((x, y))`` batched by 32 in the same
  order.

The first epoch is a warm-up; the others are timed (wall and process CPU), or with ``--counts`` (3 epochs) the
aten ops made in the second and the Python calls made in the third are counted, each in an epoch of its own
(per step, the epoch's own work included). The result (JSON)
also holds a checksum of the final weights.
"""

import argparse
import collections
import json
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

EXAMPLES = 50_000
BATCH = 32


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((EXAMPLES, 32)).astype("float32")
    y = rng.integers(0, 10, size=EXAMPLES).astype("int64")
    return x, y


def orders(epochs: int) -> list[np.ndarray]:
    """Each epoch's example order in ``fit``'s dataset (``shuffle(EXAMPLES, seed=0)``, reshuffled each
    pass), read outside the timed loop so that the hand loop takes the same batches."""
    import meshfit as mf

    index = mf.data.Dataset.from_tensor_slices(np.arange(EXAMPLES)).shuffle(EXAMPLES, seed=0).repeat(epochs)
    return np.split(np.fromiter(iter(index), dtype=np.int64, count=epochs * EXAMPLES), epochs)


class Meter:
    """What a process measures over its epochs after the first: wall and CPU time, or (``counts``, 3
    epochs) the aten ops (a dispatch mode) made in the second epoch and the Python calls
    (``sys.setprofile``'s call and c_call events) made in the third, apart: the dispatch mode's own Python
    code, run at every op, is not counted as the step's calls."""

    def __init__(self, counts: bool) -> None:
        self.counts, self.marks, self.calls = counts, [], 0
        self.ops: collections.Counter[str] = collections.Counter()
        self.counted_epochs = {"ops": 0, "calls": 0}
        self._mode: Any = None
        self._counting: str | None = None

    def epoch(self, epoch: int) -> None:
        """Called at the start of each epoch (0 the warm-up)."""
        if epoch == 1:
            self.marks.append((time.perf_counter(), time.process_time()))
        if self.counts and epoch >= 1:
            self._end_count()
            self._begin_count("ops" if epoch == 1 else "calls")

    def _begin_count(self, what: str) -> None:
        self._counting = what
        self.counted_epochs[what] += 1
        if what == "calls":
            sys.setprofile(self._profile)
            return
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self.ops

        class OpCounter(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                ops[str(func)] += 1
                return func(*args, **(kwargs or {}))

        self._mode = OpCounter()
        self._mode.__enter__()

    def _end_count(self) -> None:
        if self._counting == "calls":
            sys.setprofile(None)
        elif self._counting == "ops":
            self._mode.__exit__(None, None, None)
            self._mode = None
        self._counting = None

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            self.calls += 1

    def stop(self) -> None:
        self._end_count()
        self.marks.append((time.perf_counter(), time.process_time()))


def module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))


def run_hand(x: np.ndarray, y: np.ndarray, epochs: int, shuffle: bool, meter: Meter, fused: bool) -> nn.Module:
    model = module()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7, fused=fused or None)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    fixed = [torch.from_numpy(order) for order in orders(epochs)] if not shuffle else []
    for epoch in range(epochs):
        meter.epoch(epoch)
        order = torch.randperm(EXAMPLES) if shuffle else fixed[epoch]
        total = 0.0
        for start in range(0, EXAMPLES, BATCH):
            idx = order[start:start + BATCH]
            xb, yb = xt[idx], yt[idx]
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            total += loss.item()
    meter.stop()
    return model


def run_fit(x: np.ndarray, y: np.ndarray, epochs: int, arrays: bool, meter: Meter) -> nn.Module:
    import meshfit as mf

    class EpochClock(mf.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            meter.epoch(epoch)

        def on_train_end(self, logs=None):
            meter.stop()

    net = module()
    model = mf.Model(net)
    model.compile(optimizer=mf.optimizers.Adam(learning_rate=1e-3, epsilon=1e-7),
                  loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    clock = EpochClock()
    if arrays:
        model.fit(x, y, batch_size=BATCH, epochs=epochs, callbacks=[clock])
    else:
        dataset = mf.data.Dataset.from_tensor_slices((x, y)).shuffle(EXAMPLES, seed=0).batch(BATCH)
        model.fit(dataset, epochs=epochs, callbacks=[clock])
    return net


def _meshfit_file() -> str | None:
    module = sys.modules.get("meshfit")
    return None if module is None else module.__file__


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("variant", choices=("fit", "hand", "fit-arrays", "hand-randperm", "hand-fused"))
    parser.add_argument("--epochs", type=int, default=3, help="the first one is a warm-up")
    parser.add_argument("--counts", action="store_true",
                        help="count aten ops (2nd epoch) and Python calls (3rd) a step instead of timing (slower)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.counts and args.epochs < 3:
        parser.error(f"--counts needs --epochs 3 or more (a warm-up, ops, calls), received --epochs {args.epochs}")
    meter = Meter(args.counts)
    torch.set_num_threads(1)
    x, y = data()
    if args.variant.startswith("hand"):
        net = run_hand(x, y, args.epochs, shuffle=args.variant == "hand-randperm", meter=meter,
                       fused=args.variant == "hand-fused")
    else:
        net = run_fit(x, y, args.epochs, arrays=args.variant == "fit-arrays", meter=meter)
    (wall0, cpu0), (wall1, cpu1) = meter.marks
    per_epoch = -(-EXAMPLES // BATCH)
    steps = (args.epochs - 1) * per_epoch
    op_steps, call_steps = (max(meter.counted_epochs[k], 1) * per_epoch for k in ("ops", "calls"))
    checksum = float(sum(p.detach().double().abs().sum() for p in net.parameters()))
    with open(args.out, "w") as f:
        json.dump({"wall_ms": (wall1 - wall0) * 1e3 / steps, "cpu_ms": (cpu1 - cpu0) * 1e3 / steps,
                   "checksum": checksum, "calls": meter.calls / call_steps, "meshfit": _meshfit_file(),
                   "ops": sum(meter.ops.values()) / op_steps, "ops_by_name": dict(meter.ops)}, f)


if __name__ == "__main__":
    main()
