"""The tiny MLP of the per-step overhead measurements, one process: ``fit`` or a hand-written loop.

A process of ``bench_tiny_mlp.py``, started as a user starts a script. The model is 32-32-10 (ReLU),
Adam (learning rate 0.001, epsilon 1e-7), batch 32, 50,000 random examples, one torch thread. Both
variants take the same batch order (the same shuffled index order each epoch, made before timing)
and start from the same weights, so both do the same arithmetic.

- ``hand``: ``xb, yb = x[idx], y[idx]; opt.zero_grad(); loss = F.cross_entropy(model(xb), yb);
  loss.backward(); opt.step(); total += loss.item()`` (the loop reads its loss every step, as a
  hand-written loop that prints its progress does), torch's own ``torch.optim.Adam``.
- ``fit``: ``model.compile(Adam, SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])``
  then ``model.fit(dataset, epochs=E)`` with its default ``verbose`` (its output goes to a pipe, so the bar
  prints a line an epoch), the dataset ``Dataset.from_tensor_slices((x, y))`` batched by 32 in the same
  order.

The first epoch is a warm-up; the others are timed (wall and process CPU). The result (JSON) also holds
a checksum of the final weights.
"""

import argparse
import json
import time

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


def module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))


def run_hand(x: np.ndarray, y: np.ndarray, epochs: int, shuffle: bool) -> tuple[list, nn.Module]:
    model = module()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    fixed = [torch.from_numpy(order) for order in orders(epochs)] if not shuffle else []
    marks = []
    for epoch in range(epochs):
        if epoch == 1:
            marks.append((time.perf_counter(), time.process_time()))
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
    marks.append((time.perf_counter(), time.process_time()))
    return marks, model


def run_fit(x: np.ndarray, y: np.ndarray, epochs: int, arrays: bool) -> tuple[list, nn.Module]:
    import meshfit as mf

    class EpochClock(mf.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.marks: list = []

        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                self.marks.append((time.perf_counter(), time.process_time()))

        def on_train_end(self, logs=None):
            self.marks.append((time.perf_counter(), time.process_time()))

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
    return clock.marks, net


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("variant", choices=("fit", "hand", "fit-arrays", "hand-randperm"))
    parser.add_argument("--epochs", type=int, default=3, help="the first one is a warm-up")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y = data()
    if args.variant.startswith("hand"):
        marks, net = run_hand(x, y, args.epochs, shuffle=args.variant == "hand-randperm")
    else:
        marks, net = run_fit(x, y, args.epochs, arrays=args.variant == "fit-arrays")
    (wall0, cpu0), (wall1, cpu1) = marks
    steps = (args.epochs - 1) * -(-EXAMPLES // BATCH)
    checksum = float(sum(p.detach().double().abs().sum() for p in net.parameters()))
    with open(args.out, "w") as f:
        json.dump({"wall_ms": (wall1 - wall0) * 1e3 / steps, "cpu_ms": (cpu1 - cpu0) * 1e3 / steps,
                   "checksum": checksum}, f)


if __name__ == "__main__":
    main()
